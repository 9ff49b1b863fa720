"""What the scheduler placement needs on the local cluster, as an operator installs it:
the runner image, the runner's RBAC, a ReadWriteMany claim both nodes mount, the API
server's address for the runner's Pod, and the local cluster's `[backend]`
(`local_settings`, `claim_settings`, `scheduler_settings`, each built by
`BackendConfig.preloaded_cluster`, as the bench builds its own).

Shared by the cluster tests (their fixtures in tests/kubernetes/conftest.py, what the
fleet's tests do in tests/kubernetes/fleetparts.py) and the Kubernetes bench
(`bench/kubefleet.py`), so both install the fleet the same way.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from sandbox.backends.kubernetes import fleet
from sandbox.contracts import names
from sandbox.contracts.hostconfig import BackendConfig
from testbed.kubernetes.cluster import REPO_ROOT, Cluster

RUNNER_IMAGE = f"sandbox-runner:{names.IMAGE_TAG}"
WHEELS = REPO_ROOT / "build" / "wheels" / "runner"
CLAIM_BOUND_S = 60
VOLUME_GONE_S = 180  # the claim goes once no Pod uses it
STEP_PROFILE = "step.json"  # the step's seccomp profile as the cluster installs it


def local_settings(cluster: Cluster, namespace: str, **more: Any) -> BackendConfig:
    """The host's `[backend]` for runs on the local cluster in `namespace`: its
    kubeconfig, the images loaded on its nodes (never pulled), the step's seccomp
    profile installed there (`step.json`); `more` on top, validated. All three are
    `BackendConfig.preloaded_cluster`'s, as the bench's (`bench/kubernetes.py`)."""
    return BackendConfig.preloaded_cluster(cluster.kubeconfig, namespace, STEP_PROFILE, **more)


def claim_settings(
    cluster: Cluster, namespace: str, claim: str, root: Path, **more: Any
) -> BackendConfig:
    """`local_settings` with the run folders through the claim `claim` (`storage =
    "pvc"`), whose volume is the node's folder `root` (`hostpath_claim`)."""
    return local_settings(cluster, namespace, claim=(claim, root), **more)


def scheduler_settings(
    cluster: Cluster, namespace: str, claim: str, root: Path, runner_image: str, **more: Any
) -> BackendConfig:
    """The controller's `[backend]` for the scheduler placement: `claim_settings`, each
    run a Job of `runner_image`."""
    return claim_settings(cluster, namespace, claim, root, runner_image=runner_image, **more)


def build_runner_image(cluster: Cluster) -> str:
    """The runner image (images/runner/Dockerfile: the guard image plus the Kubernetes
    client, from wheels built once), built and loaded on every node."""
    if not any(WHEELS.glob("kubernetes-*.whl")):
        WHEELS.mkdir(parents=True, exist_ok=True)
        pip = [str(Path(sys.executable).parent / "pip"), "wheel", "--quiet", "-w", str(WHEELS)]
        subprocess.run([*pip, "kubernetes>=29,<38"], check=True, timeout=300)
    context = REPO_ROOT / "build" / f"runner-context-{secrets.token_hex(4)}"
    context.mkdir(parents=True)
    try:
        shutil.copy(REPO_ROOT / "images" / "runner" / "Dockerfile", context / "Dockerfile")
        shutil.copytree(WHEELS, context / "wheels")
        subprocess.run(
            [
                "docker",
                "build",
                "--quiet",
                "--build-arg",
                f"GUARD_IMAGE={names.GUARD_IMAGE}",
                "-t",
                RUNNER_IMAGE,
                str(context),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
    finally:
        shutil.rmtree(context, ignore_errors=True)
    cluster.load_docker_images(RUNNER_IMAGE)
    return RUNNER_IMAGE


def apply_runner_role(api: Any, namespace: str) -> None:
    """The runner's service account, Role and binding (`fleet.runner_role`)."""
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    account, role, binding = fleet.runner_role(namespace)
    core.create_namespaced_service_account(namespace, account)
    rbac.create_namespaced_role(namespace, role)
    rbac.create_namespaced_role_binding(namespace, binding)


def local_api_env(cluster: Cluster) -> dict[str, str]:
    """The local cluster's Pods reach the API server only through the node's loopback:
    the runner's Pod (on the host network) names it there."""
    return {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(cluster.state.ports.apiserver),
    }


@contextlib.contextmanager
def hostpath_claim(cluster: Cluster, core: Any, namespace: str) -> Iterator[tuple[str, Path]]:
    """A claim `runs` bound to a hostPath volume at a fresh folder of the node's storage
    (both nodes see the same folder); (the claim's name, its root). Both objects are
    deleted at the end, and the folder with them."""
    root = cluster.node_storage / f"claim-{secrets.token_hex(4)}"
    root.mkdir()
    root.chmod(0o755)
    volume = f"{namespace}-runs"
    core.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume, "labels": {"sandbox.test": "claim"}},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(root), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": "runs"},
            },
        }
    )
    try:
        created = core.create_namespaced_persistent_volume_claim(
            namespace,
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "runs"},
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": "",
                    "volumeName": volume,
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        )
        w = watch.Watch()
        for event in w.stream(
            core.list_namespaced_persistent_volume_claim,
            namespace,
            field_selector="metadata.name=runs",
            resource_version=created.metadata.resource_version,
            timeout_seconds=CLAIM_BOUND_S,
        ):
            if event["object"].status.phase == "Bound":
                w.stop()
                break
        else:
            raise TimeoutError(f"the claim was not bound within {CLAIM_BOUND_S} s")
        yield "runs", root
    finally:
        core.delete_namespaced_persistent_volume_claim("runs", namespace)
        core.delete_persistent_volume(volume)
        deadline = time.monotonic() + VOLUME_GONE_S
        while core.list_persistent_volume(field_selector=f"metadata.name={volume}").items:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the volume {volume} outlived its user")
            time.sleep(0.2)
        shutil.rmtree(root, ignore_errors=True)
