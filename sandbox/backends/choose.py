"""The backend a host's config names (each engine imported only when chosen)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sandbox.backends import Backend
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.hostconfig import BackendConfig

if TYPE_CHECKING:  # `sandbox gc` only: a test run never loads the collector
    from sandbox.backends.docker.gc import GcReport


@contextmanager
def needs_client() -> Iterator[None]:
    try:
        yield
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"the Kubernetes backend needs {exc.name!r}: pip install 'sandbox[kubernetes]'"
        ) from None


def connect_backend(config: BackendConfig) -> Backend:
    """One run's backend, connected."""
    if config.kind == "kubernetes" and config.placement == "scheduler":
        # The runner of such a run is a Job's Pod on the node the scheduler picks; run
        # here, it would do the host-side work on this host instead.
        raise ConfigError(
            "placement = 'scheduler' submits each run as a Job: `sandbox run`, "
            "`run-workflow` and `verify` (or sandbox.backends.kubernetes.fleet.FleetRun, "
            "sandbox.run.fleetchain.FleetWorkflowRun) submit it; `verify-workflow` does "
            "not run on the fleet"
        )
    if config.kind == "kubernetes":
        with needs_client():
            from sandbox.backends.kubernetes.backend import KubernetesBackend
        return KubernetesBackend.connect(config)
    from sandbox.backends.docker.backend import DockerBackend

    return DockerBackend.connect()


def collect_cluster(config: BackendConfig, report: GcReport) -> set[Path]:
    """`sandbox gc` on the cluster: the dead runs' Pods and Secrets; their run roots."""
    with needs_client():
        from sandbox.backends.kubernetes import gc, podrun
    api = podrun.connect(config)
    try:
        return gc.collect_cluster(api, config, report)
    finally:
        api.close()
