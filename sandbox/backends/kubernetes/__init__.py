"""The Kubernetes backend: a test run as one Pod (see `pod` for its shape, `podrun` for
the API calls). Imported only when the host's config selects it."""
