"""What the scheduler placement needs on the local cluster, as an operator installs it:
the runner image, the runner's RBAC, a ReadWriteMany claim both nodes mount, and the
API server's address for the runner's Pod; and what the fleet's tests do with it: a
node made the only schedulable one, a run submitted, a run held on a node, the
controller's `host.toml`, the command line in its own process.

Shared by the cluster tests (`test_fleet*.py`, `test_storage_claim.py`,
`test_two_nodes.py`; their fixtures are in `conftest.py`) and the Kubernetes bench
(`bench/kubefleet.py`), so all run the fleet the same way. The local cluster's
`[backend]` (`local_settings`, `claim_settings`, `scheduler_settings`) is built by
`BackendConfig.preloaded_cluster`, as the bench builds its own, and written to a
`host.toml` for the command line from that model (`write_host_config`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch

from sandbox.backends.kubernetes import fleet
from sandbox.contracts import names
from sandbox.contracts.guardconfig import CONFIG_FILE_NAME, GuardConfig
from sandbox.contracts.hostconfig import BackendConfig, load_host_config
from tests.conftest import write_workflow
from tests.kubernetes.cluster import REPO_ROOT, Cluster

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


# --- what the fleet's tests do -------------------------------------------------------

RUN_DEADLINE_S = 300.0
STEP_RUNNING_S = 240

# A step that holds until its run is stopped (cancelled, drained, its controller gone).
HOLD_STEP = r"""
import time
print("holding", flush=True)
time.sleep(240)  # the run is cancelled long before
"""


@contextlib.contextmanager
def only_schedulable(core: Any, node: str, nodes: list[str]) -> Iterator[None]:
    """Every node but `node` cordoned (as `kubectl cordon`) for the block."""
    others = [n for n in nodes if n != node]
    try:
        for other in others:
            core.patch_node(other, {"spec": {"unschedulable": True}})
        yield
    finally:
        for other in others:
            core.patch_node(other, {"spec": {"unschedulable": False}})


def submit(cluster: Cluster, settings: BackendConfig, wf: Path, step: str) -> fleet.FleetRun:
    """A run submitted as the controller does, its runner's Pod on its node's network."""
    return fleet.FleetRun.submit(
        settings,
        wf,
        step,
        api=cluster.api_client(),
        env=local_api_env(cluster),
        host_network=True,
    )


def hold_workflow(root: Path) -> Path:
    """A workflow under `root` whose one step (`step1`) holds (`HOLD_STEP`), no DB."""
    wf = write_workflow(
        root, command=["python3", "/workflow/code/hold.py"], timeout_s=300, db_sql=None
    )
    (wf / "code" / "hold.py").write_text(HOLD_STEP)
    return wf


def step_running_on(core: Any, namespace: str, node: str, run: fleet.FleetRun | None = None) -> Any:
    """The run's Pod once a run's step runs on `node` (watched, with a deadline); `run`,
    when known, has its runner's state and log named if none does."""
    w = watch.Watch()
    for event in w.stream(
        core.list_namespaced_pod,
        namespace,
        label_selector=f"{names.LABEL_MANAGED}=true",
        timeout_seconds=STEP_RUNNING_S,
    ):
        pod = event["object"]
        for status in pod.status.container_statuses or []:
            if status.name == "step" and status.state.running is not None:
                w.stop()
                assert pod.spec.node_name == node
                return pod
    runner = run._pod() if run is not None else None
    log = ""
    if runner is not None:
        log = core.read_namespaced_pod_log(runner.metadata.name, namespace, tail_lines=30)
    pytest.fail(
        f"no run's step ran within {STEP_RUNNING_S} s; the runner: "
        f"{runner and runner.status}\n{log}"
    )


def guard_config_of(core: Any, namespace: str, run_pod: Any) -> GuardConfig:
    """What the guard of this run's Pod reads: its config, from the run's Secret."""
    run_id = run_pod.metadata.labels[names.LABEL_RUN_ID]
    (secret,) = core.list_namespaced_secret(
        namespace, label_selector=f"{names.LABEL_RUN_ID}={run_id}"
    ).items
    return GuardConfig.model_validate_json(base64.b64decode(secret.data[CONFIG_FILE_NAME]))


def the_run(wf: Path) -> Path:
    """The workflow's one test run folder."""
    (run_dir,) = (wf / "runs").glob("test-*")
    return run_dir


def delete_jobs(api: Any, namespace: str) -> None:
    batch = client.BatchV1Api(api)
    for job in batch.list_namespaced_job(namespace).items:
        batch.delete_namespaced_job(job.metadata.name, namespace, propagation_policy="Background")


def no_jobs_left(api: Any, namespace: str) -> None:
    """Until the namespace holds no Job (polled, with a deadline)."""
    batch = client.BatchV1Api(api)
    deadline = time.monotonic() + RUN_DEADLINE_S
    while batch.list_namespaced_job(namespace).items:
        assert time.monotonic() < deadline, "the command left its Job behind"
        time.sleep(0.2)


def leases_of(api: Any, namespace: str) -> list[str]:
    """The names of the namespace's Leases."""
    items = client.CoordinationV1Api(api).list_namespaced_lease(namespace).items
    return [x.metadata.name for x in items]


def write_host_config(folder: Path, settings: BackendConfig, top: str = "") -> Path:
    """`folder/host.toml` as an operator writes it: `top` (settings before any table),
    then `settings` as its `[backend]` (what differs from the defaults); read back as
    the command reads it, it must give `settings` again."""
    lines = [top, "[backend]"] if top else ["[backend]"]
    for key, value in settings.model_dump(exclude_defaults=True).items():
        if isinstance(value, dict):  # a TOML inline table
            pairs = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items())
            lines.append(f"{key} = {{{pairs}}}")
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    path = folder / "host.toml"
    path.write_text("\n".join(lines) + "\n")
    if load_host_config(path).backend != settings:
        raise ValueError(f"{path} does not read back as {settings!r}")
    return path


def cli_host_config(folder: Path, cluster: Cluster, settings: BackendConfig, top: str = "") -> Path:
    """The controller's host.toml in `folder` (`write_host_config`): the fleet's settings,
    the runner's Pod on its node's network naming the API server's loopback address
    (what `local_api_env` gives)."""
    fleet = settings.model_copy(
        update={
            "runner_host_network": True,
            "runner_api_server": f"127.0.0.1:{cluster.state.ports.apiserver}",
        }
    )
    return write_host_config(folder, fleet, top)


def sandbox_cli(*args: str) -> subprocess.Popen[str]:
    """The real command line in its own process, as a controller starts it."""
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "sandbox"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
