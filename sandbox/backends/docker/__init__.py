"""Everything that talks to the Docker engine lives in this package.

The rest of `sandbox` hands it plain data (mounts, limits, labels) and gets
plain data back; no other module imports `docker`. A Kubernetes backend would
sit beside this package with the same surface.
"""
