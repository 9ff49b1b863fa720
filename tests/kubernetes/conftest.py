"""The local Kubernetes cluster for tests/kubernetes/: up once per session, always down.

These tests run only with `-m kubernetes` (`make test-kubernetes`): the first run
builds the Kubernetes binaries (minutes), and `make test` stays the Docker suite.
At teardown the fixture checks the host, not just the cluster's word: no process in
the cluster's namespaces or cgroups (stop() raises otherwise), no mount under its
folder, the kubelet's sysctls as they were, the pod bridge not on the host and no
iptables rule naming it, and the host's Docker engine still runs a container.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from kubernetes import client, dynamic

from sandbox.backends import BackendFactory
from sandbox.backends.choose import connect_backend
from sandbox.backends.docker import images
from sandbox.backends.kubernetes import fleet
from sandbox.contracts import names
from sandbox.contracts.hostconfig import BackendConfig
from testbed.kubernetes.cluster import (
    KUBELET_SYSCTLS,
    PRIVATE_PATHS,
    SECCOMP_DIR,
    Cluster,
    stop_orphans,
)
from testbed.kubernetes.fleetsetup import (
    apply_runner_role,
    build_runner_image,
    hostpath_claim,
    local_settings,
    scheduler_settings,
)
from testbed.kubernetes.namespace import namespace_of_its_own
from tests.kubernetes.fleetparts import delete_jobs

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this folder's tests `kubernetes`; without `-m kubernetes` they are skipped."""
    selected = "kubernetes" in (config.getoption("markexpr") or "")
    for item in items:
        if not item.path.is_relative_to(HERE):
            continue
        item.add_marker(pytest.mark.kubernetes)
        if not selected:
            item.add_marker(
                pytest.mark.skip(
                    reason="the local Kubernetes cluster runs with make test-kubernetes"
                )
            )


def _host_snapshot() -> dict[str, Any]:
    return {
        "sysctls": {
            n: Path("/proc/sys", n).read_text()
            for n in KUBELET_SYSCTLS
            if Path("/proc/sys", n).exists()
        },
        "private_paths": {p: Path(p).exists() for p in PRIVATE_PATHS},
        "netns": sorted(os.listdir("/run/netns")) if Path("/run/netns").is_dir() else [],
    }


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[Cluster]:
    """A Ready two-node cluster, the step and guard images loaded on both, `step.json` installed."""
    engine = docker.from_env(timeout=120)
    images.require(engine, names.STEP_IMAGE)
    images.require(engine, names.GUARD_IMAGE)
    stop_orphans()  # a killed session's cluster would skew the snapshot
    before = _host_snapshot()
    cluster = Cluster.start(images=(names.STEP_IMAGE, names.GUARD_IMAGE), nodes=2)
    try:
        # Its OCI form, as the node's containerd reads a Localhost profile.
        cluster.install_seccomp_profile(SECCOMP_DIR / "step.oci.json", "step.json")
        yield cluster
    finally:
        bridge, directory = cluster.state.bridge, cluster.directory
        cluster.stop()
        after = _host_snapshot()
        rules = subprocess.run(
            ["iptables-save"], capture_output=True, text=True, check=False
        ).stdout
        assert str(directory) not in Path("/proc/self/mountinfo").read_text()
        assert after == before, f"host state changed: {before} -> {after}"
        # The pod bridge and its veths live in the cluster's own network namespace.
        # (Other interfaces come and go with other users of the host's Docker engine.)
        host_links = os.listdir("/sys/class/net")
        assert bridge not in host_links
        assert not [
            n for n in host_links if Path("/sys/class/net", n, "master").resolve().name == bridge
        ]
        assert bridge not in rules and cluster.state.pod_subnet not in rules
        engine.containers.run(names.STEP_IMAGE, "true", remove=True, network_mode="bridge")


@pytest.fixture(scope="session")
def kube_api(kube_cluster: Cluster) -> Iterator[Any]:
    """A `kubernetes.client.ApiClient` with the cluster's admin token."""
    api = kube_cluster.api_client()
    yield api
    api.close()


@pytest.fixture(scope="session")
def kube_core(kube_api: Any) -> Any:
    return client.CoreV1Api(kube_api)


@pytest.fixture
def kube_namespace(kube_core: Any) -> Iterator[str]:
    """A fresh namespace whose default service account exists (Pods need it to be admitted)."""
    with namespace_of_its_own(kube_core) as name:
        yield name


@pytest.fixture
def settings(kube_cluster: Cluster, kube_namespace: str) -> BackendConfig:
    """The host's `[backend]` for runs on the cluster, in this test's namespace."""
    return local_settings(kube_cluster, kube_namespace)


@pytest.fixture
def pods(settings: BackendConfig) -> BackendFactory:
    """A run's backend: the cluster, as the host config would name it."""
    return lambda: connect_backend(settings)


@pytest.fixture
def node_dir(kube_cluster: Cluster) -> Iterator[Path]:
    """A folder of this test on the node's storage, gone after it."""
    path = kube_cluster.node_storage / f"t-{secrets.token_hex(4)}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def runner_image(kube_cluster: Cluster) -> str:
    """The runner image, built from the guard image and loaded on both nodes."""
    return build_runner_image(kube_cluster)


@pytest.fixture(scope="session")
def mcp_image(kube_cluster: Cluster) -> None:
    """The stdio MCP servers' image, loaded on both nodes."""
    kube_cluster.load_docker_images(names.MCP_IMAGE)


@pytest.fixture
def claim(kube_cluster: Cluster, kube_core: Any, kube_namespace: str) -> Iterator[tuple[str, Path]]:
    """A claim bound to a hostPath volume at a fresh folder of the node's storage."""
    with hostpath_claim(kube_cluster, kube_core, kube_namespace) as made:
        yield made


@pytest.fixture
def fleet_namespace(kube_api: Any, kube_namespace: str) -> str:
    """The namespace with the runner's service account, Role and binding and the run
    Pods' disruption budget, as an operator applies them (`fleet.runner_role`,
    `fleet.run_pod_budget`)."""
    apply_runner_role(kube_api, kube_namespace)
    # The local cluster's Kubernetes (1.20) serves the budget as policy/v1beta1.
    budget = fleet.run_pod_budget(kube_namespace, "policy/v1beta1")
    budgets = dynamic.DynamicClient(kube_api).resources.get(
        api_version=budget["apiVersion"], kind=budget["kind"]
    )
    budgets.create(body=budget, namespace=kube_namespace)
    return kube_namespace


@pytest.fixture
def fleet_settings(
    kube_cluster: Cluster,
    fleet_namespace: str,
    runner_image: str,
    claim: tuple[str, Path],
) -> BackendConfig:
    """The controller's `[backend]` for the scheduler placement, on the test's claim."""
    claim_name, root = claim
    return scheduler_settings(
        kube_cluster,
        fleet_namespace,
        claim_name,
        root,
        runner_image,
        # By digest, as an operator pins them so the gate can vouch for a run.
        image_digests=kube_cluster.pin_by_digest(names.STEP_IMAGE, names.GUARD_IMAGE),
    )


@pytest.fixture
def cleanup_jobs(kube_api: Any, fleet_namespace: str) -> Iterator[None]:
    """The namespace's Jobs deleted after the test, whatever it left."""
    yield
    delete_jobs(kube_api, fleet_namespace)
