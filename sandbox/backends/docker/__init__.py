"""The Docker Engine backend: everything that talks to the Docker engine lives here.

`backend.DockerBackend` implements the run's seam (`sandbox.backends.Backend`);
`containers`, `images` and `gc` are the Engine API calls it and the CLI's
`images`, `gc` and `doctor` commands use. The rest of `sandbox` hands this package
plain data (container specs, image names, labels) and gets plain data back.
"""
