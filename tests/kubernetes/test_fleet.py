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

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, dynamic, watch

from sandbox.backends.choose import collect_cluster
from sandbox.backends.docker.gc import GcReport
from sandbox.backends.kubernetes import fleet, lease
from sandbox.contracts import names
from sandbox.contracts.errors import RefusedError
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.record import RunStatus, read_record
from sandbox.hostfs import hostmount
from tests.conftest import tree_digest, write_workflow
from tests.kubernetes.cluster import Cluster
from tests.kubernetes.fleetparts import apply_runner_role, local_api_env
from tests.kubernetes.pods import (
    loops_of,
    no_pods_or_secrets,
    node_mounts_of,
    processes_of,
    run_objects,
)
from tests.kubernetes.test_storage_claim import claim  # noqa: F401 (a fixture)
from tests.kubernetes.test_two_nodes import only_schedulable

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

RUN_DEADLINE_S = 300.0


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
        # By digest, as an operator pins them so the gate can vouch for a run.
        image_digests=kube_cluster.pin_by_digest(names.STEP_IMAGE, names.GUARD_IMAGE),
    )


def _submit(kube_cluster: Cluster, settings: BackendConfig, wf: Path, step: str) -> fleet.FleetRun:
    return fleet.FleetRun.submit(
        settings,
        wf,
        step,
        api=kube_cluster.api_client(),
        env=local_api_env(kube_cluster),
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


HOLD_STEP = r"""
import time
print("holding", flush=True)
time.sleep(240)  # the run is cancelled long before
"""


def _step_running_on(core: Any, namespace: str, node: str, run: fleet.FleetRun) -> Any:
    """The run's Pod once its step runs there (watched, with a deadline)."""
    selector = f"{names.LABEL_MANAGED}=true"
    w = watch.Watch()
    for event in w.stream(
        core.list_namespaced_pod, namespace, label_selector=selector, timeout_seconds=240
    ):
        pod = event["object"]
        for status in pod.status.container_statuses or []:
            if status.name == "step" and status.state.running is not None:
                w.stop()
                assert pod.spec.node_name == node
                return pod
    runner = run._pod()
    log = ""
    if runner is not None:
        log = core.read_namespaced_pod_log(runner.metadata.name, namespace, tail_lines=30)
    pytest.fail(f"no run's step ran within 240 s; the runner: {runner and runner.status}\n{log}")


def _the_run(wf: Path) -> Path:
    (run_dir,) = (wf / "runs").glob("test-*")
    return run_dir


def test_the_lease_keeps_a_second_node_out_and_a_deleted_job_records_killed(
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """A runner on one node holds the workflow's Lease while its step runs; a second
    run of the same workflow, placed on the other node, is refused naming the holder.
    Deleting the first Job (cancel) ends its run as `killed`, its Pod and Secret gone,
    the Lease released: the next run on the other node passes."""
    assert fleet_settings.claim_root is not None
    wf = write_workflow(
        Path(fleet_settings.claim_root),
        command=["python3", "/workflow/code/hold.py"],
        timeout_s=300,
        db_sql=None,
    )
    (wf / "code" / "hold.py").write_text(HOLD_STEP)
    first_node, second_node = kube_cluster.node_names
    namespace = fleet_settings.namespace
    with only_schedulable(kube_core, first_node, kube_cluster.node_names):
        holder = _submit(kube_cluster, fleet_settings, wf, "step1")
        _step_running_on(kube_core, namespace, first_node, holder)
    lease_name = lease.lease_name("wf")
    held = client.CoordinationV1Api(kube_api).read_namespaced_lease(lease_name, namespace)
    assert held.spec.holder_identity.startswith(holder.name)

    with only_schedulable(kube_core, second_node, kube_cluster.node_names):
        other = _submit(kube_cluster, fleet_settings, wf, "step1")
        assert other.wait(RUN_DEADLINE_S)
    assert other.node == second_node
    with pytest.raises(RefusedError, match=held.spec.holder_identity):
        other.record()
    other.delete()

    holder.cancel()
    run_dir = _the_run(wf)
    deadline = time.monotonic() + RUN_DEADLINE_S
    while read_record(run_dir).status is RunStatus.RUNNING:
        assert time.monotonic() < deadline, "the cancelled run was never recorded"
        time.sleep(0.2)
    record = read_record(run_dir)
    assert record.status is RunStatus.KILLED, record.reason
    # The runner releases the Lease once its record is sealed, within its grace period.
    leases = client.CoordinationV1Api(kube_api)
    while leases.list_namespaced_lease(
        namespace, field_selector=f"metadata.name={lease_name}"
    ).items:
        assert time.monotonic() < deadline, "the cancelled runner kept the workflow's Lease"
        time.sleep(0.2)
    no_pods_or_secrets(kube_core, namespace)


def test_a_runner_killed_on_its_node_is_recorded_killed_by_gc_from_the_controller(
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """SIGKILL to every process of the runner's Pod (from the host, by the Pod's
    cgroup), as a node dying would: the Pod fails, the record on the claim still says
    `running`, the step's disk and view stay mounted on the node. `sandbox gc` on the
    controller (no node) marks it `killed`, removes the run's Pod and Secret, the dead
    runner's Lease and its Job, and has its mounts and loop device removed on its node."""
    assert fleet_settings.claim_root is not None
    wf = write_workflow(
        Path(fleet_settings.claim_root),
        command=["python3", "/workflow/code/hold.py"],
        timeout_s=300,
        db_sql=None,
    )
    (wf / "code" / "hold.py").write_text(HOLD_STEP)
    second_node = kube_cluster.node_names[1]
    namespace = fleet_settings.namespace
    with only_schedulable(kube_core, second_node, kube_cluster.node_names):
        run = _submit(kube_cluster, fleet_settings, wf, "step1")
        _step_running_on(kube_core, namespace, second_node, run)
    runner = run._pod()
    run_id = (runner.metadata.annotations or {}).get(fleet.ANNOTATION_RUN_ID)
    assert run_id
    victims = processes_of(runner.metadata.uid, 0)
    assert victims
    for proc in victims:
        proc.send_signal(signal.SIGKILL)
    assert run.wait(RUN_DEADLINE_S)
    run_dir = _the_run(wf)
    assert read_record(run_dir).status is RunStatus.RUNNING
    assert run_objects(kube_core, namespace)  # the run's Pod outlived its runner
    # What the dead runner mounted stays on its node: the step's disk (on its loop
    # device) and the workflow view, below the run folder.
    left = node_mounts_of(kube_cluster, second_node, run_id)
    assert any(line.endswith(f"{run_id}/.disk") for line in left), left
    assert loops_of(run_id)

    report = GcReport()
    collect_cluster(fleet_settings, report)
    assert report.errors == []
    assert report.records_marked_killed == [str(run_dir)]
    # Removed on the node by gc's cleanup Job pinned there, which gc waited for.
    assert any(p.endswith(f"{run_id}/.disk") for p in report.mounts_removed), report
    record = read_record(run_dir)
    assert record.status is RunStatus.KILLED and "sandbox gc" in record.reason
    deadline = time.monotonic() + RUN_DEADLINE_S
    while run_objects(kube_core, namespace):
        assert time.monotonic() < deadline, run_objects(kube_core, namespace)
        time.sleep(0.2)
    leases = client.CoordinationV1Api(kube_api).list_namespaced_lease(namespace).items
    assert [x.metadata.name for x in leases] == []
    batch = client.BatchV1Api(kube_api)
    while batch.list_namespaced_job(namespace).items:
        assert time.monotonic() < deadline, "the dead runner's or the cleanup's Job was left"
        time.sleep(0.2)
    # The loop device goes with the last user of its mount (the run's Pod, gone now).
    while node_mounts_of(kube_cluster, second_node, run_id) or loops_of(run_id):
        assert time.monotonic() < deadline, (
            node_mounts_of(kube_cluster, second_node, run_id),
            loops_of(run_id),
        )
        time.sleep(0.2)


def _cli_host_config(tmp_path: Path, kube_cluster: Cluster, settings: BackendConfig) -> Path:
    """The controller's host.toml: the fleet's settings, the runner's Pod on its node's
    network naming the API server's loopback address (what `local_api_env` gives)."""
    fields: dict[str, Any] = {
        **settings.model_dump(exclude_defaults=True),
        "runner_host_network": True,
        "runner_api_server": f"127.0.0.1:{kube_cluster.state.ports.apiserver}",
    }
    lines = ["[backend]"]
    for key, value in fields.items():
        if isinstance(value, dict):  # a TOML inline table
            pairs = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items())
            lines.append(f"{key} = {{{pairs}}}")
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    path = tmp_path / "host.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _sandbox_cli(*args: str) -> subprocess.Popen[str]:
    """The real command line in its own process, as a controller starts it."""
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "sandbox"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _no_jobs_left(kube_api: Any, namespace: str) -> None:
    batch = client.BatchV1Api(kube_api)
    deadline = time.monotonic() + RUN_DEADLINE_S
    while batch.list_namespaced_job(namespace).items:
        assert time.monotonic() < deadline, "the command left its Job behind"
        time.sleep(0.2)


def test_sandbox_run_submits_to_the_fleet_follows_it_and_exits_as_any_run(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """`sandbox run --backend kubernetes` with `placement = "scheduler"`: the run lands
    on the node the scheduler may pick (only the second here), `--follow --json` prints
    the placement and the runner's phases, then the record read from the claim; exit 0;
    the Job removed."""
    assert fleet_settings.claim_root is not None
    wf = write_workflow(
        Path(fleet_settings.claim_root), command=["python3", "/workflow/code/step.py"]
    )
    (wf / "code" / "step.py").write_text(CHAIN_STEP)
    before = tree_digest(wf)
    host = _cli_host_config(tmp_path, kube_cluster, fleet_settings)
    second_node = kube_cluster.node_names[1]
    argv = ["run", str(wf), "step1", "--backend", "kubernetes", "--host-config", str(host)]
    with only_schedulable(kube_core, second_node, kube_cluster.node_names):
        proc = _sandbox_cli(*argv, "--follow", "--json")
        out, err = proc.communicate(timeout=RUN_DEADLINE_S)
    assert proc.returncode == 0, (out, err)
    *events, last = [json.loads(line) for line in out.splitlines()]
    record = read_record(wf / "runs" / last["id"])
    assert last["status"] == "passed" and record.status is RunStatus.PASSED
    assert record.node == second_node
    assert {e["kind"] for e in events} == {"placed", "runner"}
    assert [e["node"] for e in events if e["kind"] == "placed"] == [second_node]
    phases = [e["phase"] for e in events if e["kind"] == "runner"]
    assert phases[-1] == "Succeeded", phases
    assert (wf / "runs" / record.id / "g" / "out.txt").read_text() == 'name = "wf"'
    assert tree_digest(wf) == before
    _no_jobs_left(kube_api, fleet_settings.namespace)
    no_pods_or_secrets(kube_core, fleet_settings.namespace)


def test_sandbox_run_on_the_fleet_stopped_deletes_the_job_and_prints_the_killed_record(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """SIGTERM to the command while the step runs on a node: it deletes the Job, the
    runner ends the run `killed`, and the command prints that record and exits 130,
    leaving no Job, Pod, Secret or Lease."""
    assert fleet_settings.claim_root is not None
    wf = write_workflow(
        Path(fleet_settings.claim_root),
        command=["python3", "/workflow/code/hold.py"],
        timeout_s=300,
        db_sql=None,
    )
    (wf / "code" / "hold.py").write_text(HOLD_STEP)
    host = _cli_host_config(tmp_path, kube_cluster, fleet_settings)
    first_node = kube_cluster.node_names[0]
    namespace = fleet_settings.namespace
    argv = ["run", str(wf), "step1", "--backend", "kubernetes", "--host-config", str(host)]
    with only_schedulable(kube_core, first_node, kube_cluster.node_names):
        proc = _sandbox_cli(*argv, "--json")
        try:
            _step_of_a_run_running_on(kube_core, namespace, first_node)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=RUN_DEADLINE_S)
    assert proc.returncode == 130, (out, err)
    printed = json.loads(out.splitlines()[-1])
    record = read_record(_the_run(wf))
    assert printed["id"] == record.id and printed["status"] == "killed"
    assert record.status is RunStatus.KILLED
    _no_jobs_left(kube_api, namespace)
    no_pods_or_secrets(kube_core, namespace)
    leases = client.CoordinationV1Api(kube_api).list_namespaced_lease(namespace).items
    assert [x.metadata.name for x in leases] == []


def _step_of_a_run_running_on(core: Any, namespace: str, node: str) -> None:
    """Until a run's step runs on `node` (watched, with a deadline)."""
    w = watch.Watch()
    for event in w.stream(
        core.list_namespaced_pod,
        namespace,
        label_selector=f"{names.LABEL_MANAGED}=true",
        timeout_seconds=240,
    ):
        pod = event["object"]
        for status in pod.status.container_statuses or []:
            if status.name == "step" and status.state.running is not None:
                w.stop()
                assert pod.spec.node_name == node
                return
    pytest.fail("no run's step ran within 240 s")
