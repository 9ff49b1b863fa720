"""What the fleet's tests do on the local cluster: a node made the only schedulable one,
a run submitted, a run held on a node, the controller's `host.toml`, the command line
in its own process. What an operator installs for the fleet (the runner image, its
RBAC, the claim, the local cluster's `[backend]`) is testbed/kubernetes/fleetsetup.py,
shared with the bench.

Shared by the cluster tests (`test_fleet*.py`, `test_storage_claim.py`,
`test_two_nodes.py`; their fixtures are in `conftest.py`). A `host.toml` for the
command line is written from the `[backend]` model (`write_host_config`).
"""

from __future__ import annotations

import base64
import contextlib
import json
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
from testbed.kubernetes.cluster import Cluster
from testbed.kubernetes.fleetsetup import local_api_env
from tests.conftest import write_workflow

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
