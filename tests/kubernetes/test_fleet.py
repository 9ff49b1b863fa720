"""The scheduler placement (`placement = "scheduler"`): the runner as a Job's Pod.

The controller here is the test process: it submits each run as a Job and reads the
record from its own view of the shared claim; the host-side work happens inside the
runner's Pod on whichever node the scheduler picked. The runner image is the guard
image plus the Kubernetes client (images/runner/Dockerfile), built by `fleetsetup`.

The local cluster's Pods reach the API server only through the node's loopback, so
the runner's Pod here uses the host network and names the API server by its
loopback address (what a real cluster's Service does for in-cluster clients).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from kubernetes import client

from sandbox.backends.choose import collect_cluster
from sandbox.backends.docker.gc import GcReport
from sandbox.backends.kubernetes import fleet, lease
from sandbox.backends.kubernetes import gc as kube_gc
from sandbox.contracts.errors import RefusedError
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.names import LABEL_RUN_ID
from sandbox.contracts.record import RunStatus, read_record
from sandbox.hostfs import hostmount
from testbed.kubernetes.cluster import Cluster
from tests.conftest import tree_digest, write_workflow
from tests.kubernetes.fleetparts import (
    RUN_DEADLINE_S,
    cli_host_config,
    guard_config_of,
    hold_workflow,
    leases_of,
    no_jobs_left,
    only_schedulable,
    sandbox_cli,
    step_running_on,
    submit,
    the_run,
)
from tests.kubernetes.pods import (
    loops_of,
    no_pods_or_secrets,
    node_mounts_of,
    processes_of,
    run_objects,
)

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

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
            run = submit(kube_cluster, fleet_settings, wf, "step1")
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
    wf = hold_workflow(Path(fleet_settings.claim_root))
    first_node, second_node = kube_cluster.node_names
    namespace = fleet_settings.namespace
    with only_schedulable(kube_core, first_node, kube_cluster.node_names):
        holder = submit(kube_cluster, fleet_settings, wf, "step1")
        step_running_on(kube_core, namespace, first_node, holder)
    lease_name = lease.lease_name("wf")
    held = client.CoordinationV1Api(kube_api).read_namespaced_lease(lease_name, namespace)
    assert held.spec.holder_identity.startswith(holder.name)

    with only_schedulable(kube_core, second_node, kube_cluster.node_names):
        other = submit(kube_cluster, fleet_settings, wf, "step1")
        assert other.wait(RUN_DEADLINE_S)
    assert other.node == second_node
    with pytest.raises(RefusedError, match=held.spec.holder_identity):
        other.record()
    other.delete()

    holder.cancel()
    run_dir = the_run(wf)
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


class _PodTakenFirst(client.ApiClient):  # type: ignore[misc]
    """gc's client to the real API server, but the test itself deletes the run's Pod
    just before gc's own delete of it is sent: the cluster took it meanwhile (as it
    takes a run's Secret with its Pod, its owner, while gc goes through a dead runner's
    objects), at the one moment that makes gc's delete find it gone, every time. Every
    call still goes to the cluster, and its answer (here a 404) is gc's."""

    def __init__(self, configuration: Any, core: Any, namespace: str, pod: str) -> None:
        super().__init__(configuration)
        self.core, self.namespace, self.pod = core, namespace, pod
        self.taken = False

    def call_api(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        path = f"/api/v1/namespaces/{self.namespace}/pods/{self.pod}"
        if method == "DELETE" and urlsplit(url).path == path and not self.taken:
            self.core.delete_namespaced_pod(self.pod, self.namespace, grace_period_seconds=0)
            deadline = time.monotonic() + RUN_DEADLINE_S
            while self.core.list_namespaced_pod(
                self.namespace, field_selector=f"metadata.name={self.pod}"
            ).items:
                assert time.monotonic() < deadline, f"the test could not delete {self.pod}"
                time.sleep(0.2)
            self.taken = True
        return super().call_api(method, url, *args, **kwargs)


@pytest.mark.parametrize("taken_meanwhile", [False, True], ids=["gc-alone", "pod-taken-meanwhile"])
def test_a_runner_killed_on_its_node_is_recorded_killed_by_gc_from_the_controller(
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
    taken_meanwhile: bool,
) -> None:
    """SIGKILL to every process of the runner's Pod (from the host, by the Pod's
    cgroup), as a node dying would: the Pod fails, the record on the claim still says
    `running`, the step's disk and view stay mounted on the node. `sandbox gc` on the
    controller (no node) marks it `killed`, removes the run's Pod and Secret, the dead
    runner's Lease and its Job, and has its mounts and loop device removed on its node.
    The same when the run's Pod is gone by the time gc deletes it (`_PodTakenFirst`):
    gc must go on past that 404 (stopping there left the node's mounts, the Lease and
    the Job behind)."""
    assert fleet_settings.claim_root is not None
    wf = hold_workflow(Path(fleet_settings.claim_root))
    second_node = kube_cluster.node_names[1]
    namespace = fleet_settings.namespace
    with only_schedulable(kube_core, second_node, kube_cluster.node_names):
        run = submit(kube_cluster, fleet_settings, wf, "step1")
        step_running_on(kube_core, namespace, second_node, run)
    runner = run._pod()
    run_id = (runner.metadata.annotations or {}).get(fleet.ANNOTATION_RUN_ID)
    assert run_id
    victims = processes_of(runner.metadata.uid, 0)
    assert victims
    for proc in victims:
        proc.send_signal(signal.SIGKILL)
    assert run.wait(RUN_DEADLINE_S)
    run_dir = the_run(wf)
    assert read_record(run_dir).status is RunStatus.RUNNING
    assert run_objects(kube_core, namespace)  # the run's Pod outlived its runner
    # What the dead runner mounted stays on its node: the step's disk (on its loop
    # device) and the workflow view, below the run folder.
    left = node_mounts_of(kube_cluster, second_node, run_id)
    assert any(line.endswith(f"{run_id}/.disk") for line in left), left
    assert loops_of(run_id)

    (run_pod,) = kube_core.list_namespaced_pod(
        namespace, label_selector=f"{LABEL_RUN_ID}={run_id}"
    ).items
    report = GcReport()
    if taken_meanwhile:
        racing = _PodTakenFirst(kube_api.configuration, kube_core, namespace, run_pod.metadata.name)
        try:
            kube_gc.collect_cluster(racing, fleet_settings, report)  # `sandbox gc`'s part
        finally:
            racing.close()
        assert racing.taken and report.pods_removed == []  # gc found it gone
    else:
        collect_cluster(fleet_settings, report)
        assert report.pods_removed == [run_pod.metadata.name]
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
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings)
    second_node = kube_cluster.node_names[1]
    argv = ["run", str(wf), "step1", "--backend", "kubernetes", "--host-config", str(host)]
    with only_schedulable(kube_core, second_node, kube_cluster.node_names):
        proc = sandbox_cli(*argv, "--follow", "--json")
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
    no_jobs_left(kube_api, fleet_settings.namespace)
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
    wf = hold_workflow(Path(fleet_settings.claim_root))
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings)
    first_node = kube_cluster.node_names[0]
    namespace = fleet_settings.namespace
    argv = ["run", str(wf), "step1", "--backend", "kubernetes", "--host-config", str(host)]
    with only_schedulable(kube_core, first_node, kube_cluster.node_names):
        proc = sandbox_cli(*argv, "--json")
        try:
            step_running_on(kube_core, namespace, first_node)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=RUN_DEADLINE_S)
    assert proc.returncode == 130, (out, err)
    printed = json.loads(out.splitlines()[-1])
    record = read_record(the_run(wf))
    assert printed["id"] == record.id and printed["status"] == "killed"
    assert record.status is RunStatus.KILLED
    no_jobs_left(kube_api, namespace)
    no_pods_or_secrets(kube_core, namespace)
    leases = client.CoordinationV1Api(kube_api).list_namespaced_lease(namespace).items
    assert [x.metadata.name for x in leases] == []


# Long enough for the test to read the run's guard config while the step runs.
SLOW_STEP = r"""
import time
time.sleep(30)
"""

CARRIED = """\
durability = "per-call"

[recording]
cap_bytes = 12345678
body_cap_bytes = 1234567
"""


def test_the_controllers_durability_and_recording_settings_go_to_the_runner(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """`durability = "per-call"` and `[recording]` caps in the controller's host.toml:
    the run the scheduler places honours them as a run on the controller's own host
    would. Its guard's config (what the guard reads, from the run's Secret) says
    per-call with those caps while the step runs, and the record names the caps."""
    assert fleet_settings.claim_root is not None
    wf = write_workflow(
        Path(fleet_settings.claim_root), command=["python3", "/workflow/code/slow.py"]
    )
    (wf / "code" / "slow.py").write_text(SLOW_STEP)
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings, CARRIED)
    node = kube_cluster.node_names[0]
    namespace = fleet_settings.namespace
    argv = ["run", str(wf), "step1", "--backend", "kubernetes", "--host-config", str(host)]
    with only_schedulable(kube_core, node, kube_cluster.node_names):
        proc = sandbox_cli(*argv, "--json")
        try:
            guard = guard_config_of(
                kube_core, namespace, step_running_on(kube_core, namespace, node)
            )
        finally:
            out, err = proc.communicate(timeout=RUN_DEADLINE_S)
    assert proc.returncode == 0, (out, err)
    assert guard.durability == "per-call"
    assert (guard.recording.cap_bytes, guard.recording.body_cap_bytes) == (12345678, 1234567)
    record = read_record(wf / "runs" / json.loads(out.splitlines()[-1])["id"])
    assert record.status is RunStatus.PASSED, record.reason
    assert record.recording is not None
    assert (record.recording.cap_bytes, record.recording.body_cap_bytes) == (12345678, 1234567)
    no_jobs_left(kube_api, namespace)
    no_pods_or_secrets(kube_core, namespace)
    assert leases_of(kube_api, namespace) == []
