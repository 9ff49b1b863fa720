"""The bridge API the step calls: its routes, the upstream client, the identity bindings."""
