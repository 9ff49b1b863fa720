"""The scheduler placement (`placement = "scheduler"`): the runner as a Job's Pod.

The controller here is the test process: it submits each run as a Job and reads the
record from its own view of the shared claim; the host-side work happens inside the
runner's Pod on whichever node the scheduler picked. The runner image is the guard
image plus the Kubernetes client (images/runner/Dockerfile), built by this module.

The local cluster's Pods reach the API server only through the node's loopback, so
the runner's Pod here uses the host network and names the API server by its
loopback address (what a real cluster's Service does for in-cluster clients).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from sandbox.backends.kubernetes import fleet
from sandbox.contracts import names
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.record import RunStatus
from sandbox.hostfs import hostmount
from tests.conftest import tree_digest, write_workflow
from tests.kubernetes.cluster import REPO_ROOT, Cluster
from tests.kubernetes.pods import no_pods_or_secrets
from tests.kubernetes.test_storage_claim import claim  # noqa: F401 (a fixture)
from tests.kubernetes.test_two_nodes import only_schedulable

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

RUNNER_IMAGE = f"sandbox-runner:{names.IMAGE_TAG}"
WHEELS = REPO_ROOT / "build" / "wheels" / "runner"
RUN_DEADLINE_S = 300.0


@pytest.fixture(scope="module")
def runner_image(kube_cluster: Cluster) -> str:
    """The runner image, built from the guard image and loaded on both nodes."""
    if not any(WHEELS.glob("kubernetes-*.whl")):
        WHEELS.mkdir(parents=True, exist_ok=True)
        pip = [str(Path(sys.executable).parent / "pip"), "wheel", "--quiet", "-w", str(WHEELS)]
        subprocess.run([*pip, "kubernetes>=29,<38"], check=True, timeout=300)
    context = REPO_ROOT / "build" / "runner-context"
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
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
    shutil.rmtree(context, ignore_errors=True)
    kube_cluster.load_docker_images(RUNNER_IMAGE)
    return RUNNER_IMAGE


@pytest.fixture
def fleet_namespace(kube_api: Any, kube_namespace: str) -> str:
    """The namespace with the runner's service account, Role and binding, as an
    operator applies them (`fleet.runner_role`)."""
    core, rbac = client.CoreV1Api(kube_api), client.RbacAuthorizationV1Api(kube_api)
    account, role, binding = fleet.runner_role(kube_namespace)
    core.create_namespaced_service_account(kube_namespace, account)
    rbac.create_namespaced_role(kube_namespace, role)
    rbac.create_namespaced_role_binding(kube_namespace, binding)
    return kube_namespace


@pytest.fixture
def fleet_settings(
    kube_cluster: Cluster,
    fleet_namespace: str,
    runner_image: str,
    claim: tuple[str, Path],  # noqa: F811
) -> BackendConfig:
    claim_name, root = claim
    return BackendConfig(
        kind="kubernetes",
        kubeconfig=str(kube_cluster.kubeconfig),
        namespace=fleet_namespace,
        image_pull_policy="Never",
        seccomp_profile="step.json",
        storage="pvc",
        claim=claim_name,
        claim_root=str(root),
        placement="scheduler",
        runner_image=runner_image,
    )


def _local_api(kube_cluster: Cluster) -> dict[str, str]:
    return {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(kube_cluster.state.ports.apiserver),
    }


def _submit(kube_cluster: Cluster, settings: BackendConfig, wf: Path, step: str) -> fleet.FleetRun:
    return fleet.FleetRun.submit(
        settings,
        wf,
        step,
        api=kube_cluster.api_client(),
        env=_local_api(kube_cluster),
        host_network=True,
    )


def _no_jobs(kube_api: Any, namespace: str) -> None:
    batch = client.BatchV1Api(kube_api)
    for job in batch.list_namespaced_job(namespace).items:
        batch.delete_namespaced_job(job.metadata.name, namespace, propagation_policy="Background")


@pytest.fixture
def cleanup_jobs(kube_api: Any, fleet_namespace: str) -> Iterator[None]:
    yield
    _no_jobs(kube_api, fleet_namespace)


CHAIN_STEP = r"""
import os, sqlite3
con = sqlite3.connect(os.environ["DB_PATH"])
con.execute("INSERT INTO t VALUES (7, 'from the fleet')")
con.commit()
open("out.txt", "w").write(open("/workflow/workflow.toml").read().splitlines()[0])
"""


def test_scheduler_placed_runs_land_on_each_node_and_the_controller_reads_the_record(
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    assert fleet_settings.claim_root is not None
    wf = write_workflow(
        Path(fleet_settings.claim_root), command=["python3", "/workflow/code/step.py"]
    )
    (wf / "code" / "step.py").write_text(CHAIN_STEP)
    before = tree_digest(wf)
    landed = []
    for node in kube_cluster.node_names:
        with only_schedulable(kube_core, node, kube_cluster.node_names):
            run = _submit(kube_cluster, fleet_settings, wf, "step1")
            events: list[tuple[str, dict[str, Any]]] = []

            def seen(kind: str, fields: dict[str, Any], into: list[Any] = events) -> None:
                into.append((kind, fields))

            assert run.wait(RUN_DEADLINE_S, seen)
        record = run.record()
        assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
        # The runner's Pod and the run's Pod were on the same node, the one picked.
        assert run.node == node and record.node == node
        placed = [f for k, f in events if k == "placed"]
        assert len(placed) == 1 and placed[0]["node"] == node
        assert ("runner", {"phase": "Succeeded", "node": node}) in events
        group = wf / "runs" / record.id / "g" / "out.txt"
        assert group.read_text() == 'name = "wf"'
        assert record.db_copy is not None and record.db_diff is not None
        landed.append(record.node)
        run.delete()
        run.close()
    assert landed == kube_cluster.node_names
    assert tree_digest(wf) == before  # the real workflow folder, byte for byte
    assert not hostmount.mounts_below(wf)
    no_pods_or_secrets(kube_core, fleet_settings.namespace)
