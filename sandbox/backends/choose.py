"""The backend a host's config names, connected (each engine imported only when chosen)."""

from __future__ import annotations

from sandbox.backends import Backend
from sandbox.contracts.hostconfig import BackendConfig


def connect_backend(config: BackendConfig) -> Backend:
    if config.kind == "kubernetes":
        from sandbox.backends.kubernetes.backend import KubernetesBackend

        return KubernetesBackend.connect(config)
    from sandbox.backends.docker.backend import DockerBackend

    return DockerBackend.connect()
