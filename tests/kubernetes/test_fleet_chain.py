"""`run-workflow` and `verify` with the scheduler placement: each step its own runner Job.

The controller is the command line in its own process (as a controller starts it):
it sequences the chain on the claim and submits each step as a Job the scheduler
places; the chain's state (the DB copy, the group folders) lives on the claim, so a
step placed on the other node still sees what the step before it wrote. Which node
may take a step is forced by cordoning the other one, as `kubectl cordon` does.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from sandbox.backends.choose import collect_cluster
from sandbox.backends.docker.gc import GcReport
from sandbox.backends.kubernetes import fleet, lease
from sandbox.contracts import names
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.record import RunStatus, read_record
from sandbox.contracts.workflow_record import StepState, WorkflowRunRecord
from sandbox.hostfs import hostmount
from testbed.kubernetes.cluster import Cluster
from tests.conftest import tree_digest
from tests.kubernetes.fleetparts import (
    RUN_DEADLINE_S,
    cli_host_config,
    delete_jobs,
    guard_config_of,
    leases_of,
    no_jobs_left,
    only_schedulable,
    sandbox_cli,
    step_running_on,
    the_run,
)
from tests.kubernetes.pods import (
    loops_of,
    no_pods_or_secrets,
    node_mounts_of,
    processes_of,
    run_objects,
)
from tests.scenarios.workflowparts import chain_workflow, validate

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

PICK = """\
import os, pathlib, sqlite3
db = sqlite3.connect(os.environ["DB_PATH"])
db.execute("INSERT INTO t VALUES (2, 'claimed by pick')")
db.commit()
pathlib.Path("note.txt").write_text("from pick")
"""

SUBMIT = """\
import os, pathlib, sqlite3
db = sqlite3.connect(os.environ["DB_PATH"])
row = db.execute("SELECT v FROM t WHERE id = 2").fetchone()
assert row == ("claimed by pick",), row
assert pathlib.Path("note.txt").read_text() == "from pick"
assert pathlib.Path("earlier.txt").read_text() == "real run"
db.execute("INSERT INTO t VALUES (3, 'submitted')")
db.commit()
pathlib.Path("proposal.txt").write_text("submitted")
"""

HOLD = """\
import time
print("holding", flush=True)
time.sleep(240)  # the chain is stopped long before
"""


def _chain(root: Path, steps: dict[str, str], expect: str = "") -> Path:
    """A workflow `wf` whose steps (in this order, one group `g`) run these Python bodies
    (each with the `expect` tables after it), with a DB of one row and a real run whose
    `g` folder holds `earlier.txt` (`workflowparts.chain_workflow`)."""
    return chain_workflow(
        root,
        [(step_id, "g", body) for step_id, body in steps.items()],
        name="wf",
        timeout_s=300,
        expect=expect,
        preamble="",
    )


def _lines(proc: subprocess.Popen[str]) -> Iterator[dict[str, Any]]:
    """The command's JSON lines as it prints them (it ends: the lines end)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        yield json.loads(line)


def test_a_chain_whose_steps_land_on_different_nodes_carries_its_db_copy_and_group_folder(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """`sandbox run-workflow` on the fleet: step `pick` may land on the first node only,
    then (once it was placed) step `submit` on the second only. `submit` sees the row
    `pick` wrote into the chain's DB copy and the file it left in the group folder; the
    records the controller reads name both nodes; the real workflow is unchanged."""
    assert fleet_settings.claim_root is not None
    wf = _chain(Path(fleet_settings.claim_root), {"pick": PICK, "submit": SUBMIT})
    real_db = (wf / "db" / "db.sqlite").read_bytes()
    before = tree_digest(wf)
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings)
    first, second = kube_cluster.node_names
    argv = ["run-workflow", str(wf), "--backend", "kubernetes", "--host-config", str(host)]
    events: list[dict[str, Any]] = []
    with only_schedulable(kube_core, first, kube_cluster.node_names):
        proc = sandbox_cli(*argv, "--follow", "--json")
        lines = _lines(proc)
        for line in lines:
            events.append(line)
            if line.get("kind") == "placed":
                break
    with only_schedulable(kube_core, second, kube_cluster.node_names):
        events.extend(lines)
        out, err = proc.communicate(timeout=RUN_DEADLINE_S)
    assert proc.returncode == 0, (events[-3:], out, err)
    *events, last = events
    chain = WorkflowRunRecord.model_validate(last)
    assert chain.status is RunStatus.PASSED, chain.reason
    placed = [(e["index"], e["step_id"], e["node"]) for e in events if e["kind"] == "placed"]
    assert placed == [(1, "pick", first), (2, "submit", second)]

    # The records the controller reads from the claim: each step's names its node.
    root = wf / "runs" / chain.id
    steps = {e.step_id: e for e in chain.steps}
    assert [e.status for e in chain.steps] == [StepState.PASSED, StepState.PASSED]
    pick = read_record(root / Path(str(steps["pick"].record)).parent)
    submit = read_record(root / Path(str(steps["submit"].record)).parent)
    assert (pick.node, submit.node) == (first, second)
    assert pick.workflow_run_id == submit.workflow_run_id == chain.id
    # What the chain carried: the last step's DB copy and group folder.
    assert chain.db is not None and chain.groups["g"]
    con = sqlite3.connect(root / chain.db)
    assert con.execute("SELECT id, v FROM t ORDER BY id").fetchall() == [
        (1, "one"),
        (2, "claimed by pick"),
        (3, "submitted"),
    ]
    con.close()
    group = root / chain.groups["g"]
    assert (group / "note.txt").read_text() == "from pick"
    assert (group / "proposal.txt").read_text() == "submitted"
    assert chain.db_diff is not None
    # The real workflow folder and DB, byte for byte.
    assert tree_digest(wf) == before
    assert (wf / "db" / "db.sqlite").read_bytes() == real_db
    assert not hostmount.mounts_below(wf)
    no_jobs_left(kube_api, fleet_settings.namespace)
    no_pods_or_secrets(kube_core, fleet_settings.namespace)
    leases = client.CoordinationV1Api(kube_api).list_namespaced_lease(fleet_settings.namespace)
    assert [x.metadata.name for x in leases.items] == []


def test_a_stopped_chain_on_the_fleet_records_killed_and_leaves_nothing_behind(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """SIGTERM to `sandbox run-workflow` while its first step runs on a node: the
    step's Job is deleted, its runner records the step `killed`, the chain's record
    says `killed` with the rest skipped; the command prints it and exits 130, leaving
    no Job, Pod, Secret or Lease."""
    assert fleet_settings.claim_root is not None
    wf = _chain(Path(fleet_settings.claim_root), {"hold": HOLD, "after": PICK})
    before = tree_digest(wf)
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings)
    second = kube_cluster.node_names[1]
    namespace = fleet_settings.namespace
    argv = ["run-workflow", str(wf), "--backend", "kubernetes", "--host-config", str(host)]
    with only_schedulable(kube_core, second, kube_cluster.node_names):
        proc = sandbox_cli(*argv, "--json")
        try:
            step_running_on(kube_core, namespace, second)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=RUN_DEADLINE_S)
    assert proc.returncode == 130, (out, err)
    chain = WorkflowRunRecord.model_validate_json(out.splitlines()[-1])
    assert chain.status is RunStatus.KILLED, chain.reason
    assert [e.status for e in chain.steps] == [StepState.KILLED, StepState.SKIPPED]
    on_claim = WorkflowRunRecord.model_validate_json(
        (wf / "runs" / chain.id / "test_mode.json").read_text()
    )
    assert on_claim.status is RunStatus.KILLED
    step = read_record(wf / "runs" / chain.id / Path(str(chain.steps[0].record)).parent)
    assert step.status is RunStatus.KILLED
    assert tree_digest(wf) == before
    no_jobs_left(kube_api, namespace)
    no_pods_or_secrets(kube_core, namespace)
    leases = client.CoordinationV1Api(kube_api).list_namespaced_lease(namespace).items
    assert [x.metadata.name for x in leases] == []


GOOD = """\
import os, sqlite3
db = sqlite3.connect(os.environ["DB_PATH"])
db.execute("INSERT INTO t VALUES (5, 'verified')")
db.commit()
"""

BAD = """\
raise SystemExit(3)
"""

INSERTS_ROW_5 = """\
[[steps.expect]]
name = "inserts row 5"
kind = "db"
table = "t"
where = { id = 5 }
count = 1
"""


def test_verify_on_the_fleet_writes_the_verdict_on_the_claim_and_the_controller_reads_it(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """`sandbox verify` on the fleet: the runner (on the node the scheduler picked)
    judges the run and writes the verification beside its record and into the
    workflow's history on the claim; the command prints what it reads there. A good
    step verifies (exit 0); a step that fails is not verified (exit 1), and the gate
    holds it back."""
    assert fleet_settings.claim_root is not None
    wf = _chain(Path(fleet_settings.claim_root), {"good": GOOD, "bad": BAD}, INSERTS_ROW_5)
    before = tree_digest(wf)
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings)
    first = kube_cluster.node_names[0]
    verdicts = {}
    with only_schedulable(kube_core, first, kube_cluster.node_names):
        for step in ("good", "bad"):
            argv = ["verify", str(wf), step, "--host-config", str(host), "--json"]
            proc = sandbox_cli(*argv)
            out, err = proc.communicate(timeout=RUN_DEADLINE_S)
            assert out, (step, proc.returncode, err)
            verdicts[step] = (proc.returncode, json.loads(out.splitlines()[-1]), err)
    code, good, err = verdicts["good"]
    assert code == 0 and good["passed"] is True, (good, err)
    code, bad, err = verdicts["bad"]
    assert code == 1 and bad["passed"] is False, (bad, err)
    for verdict in (good, bad):
        run_root = wf / "runs" / verdict["run_id"]
        on_claim = json.loads((run_root / "verification.json").read_text())
        assert on_claim["run_id"] == verdict["run_id"] and on_claim["passed"] == verdict["passed"]
        assert read_record(run_root).node == first
    history = (wf / "runs" / "test-verifications" / "verifications.jsonl").read_text()
    assert good["run_id"] in history and bad["run_id"] in history
    gate = sandbox_cli("gate", str(wf), "bad", "--json")
    out, err = gate.communicate(timeout=120)
    assert gate.returncode == 1 and json.loads(out)["ok"] is False, (out, err)
    # The images ran by digest (the controller's mapping, carried to the runner): the
    # gate, with the controller's config, vouches for the good step's verification.
    step_ref = fleet_settings.image_digests[names.STEP_IMAGE]
    content = read_record(wf / "runs" / good["run_id"]).content
    assert content is not None and content.parts["image step"] == step_ref
    gate = sandbox_cli("gate", str(wf), "good", "--host-config", str(host), "--json")
    out, err = gate.communicate(timeout=120)
    assert gate.returncode == 0 and json.loads(out) == {
        "ok": True,
        "reason": f"good verified at its current version ({good['run_id']})",
    }, (out, err)
    # Named by tag, the same images are no version the gate can vouch for.
    (tmp_path / "tags").mkdir()
    by_tag = fleet_settings.model_copy(update={"image_digests": {}})
    tags = cli_host_config(tmp_path / "tags", kube_cluster, by_tag)
    gate = sandbox_cli("gate", str(wf), "good", "--host-config", str(tags), "--json")
    out, err = gate.communicate(timeout=120)
    assert gate.returncode == 1 and json.loads(out)["reason"] == (
        "good not verified: the version hash could not cover image step: "
        f"{names.STEP_IMAGE} is named by tag, not by content"
    ), (out, err)
    assert tree_digest(wf) == before
    no_jobs_left(kube_api, fleet_settings.namespace)
    no_pods_or_secrets(kube_core, fleet_settings.namespace)


def _chain_record(wf: Path) -> WorkflowRunRecord:
    """The chain's record on the claim, validated."""
    return WorkflowRunRecord.model_validate_json((the_run(wf) / "test_mode.json").read_text())


def _gc(settings: BackendConfig) -> GcReport:
    """`sandbox gc`'s cluster part, as the command runs it with the controller's config."""
    report = GcReport()
    collect_cluster(settings, report)
    assert report.errors == [], report
    return report


def test_gc_records_a_chain_killed_once_its_controller_is_gone_and_never_while_it_lives(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """`sandbox run-workflow` on the fleet, its first step holding on a node (its runner
    honours the controller's `durability = "per-call"`). `sandbox gc` while the controller
    lives leaves the chain `running`, its Job and its Lease. The controller is SIGKILLed:
    its step's runner still runs and renews the chain's Lease, so gc leaves it again.
    Once the step's Job is deleted (its runner records the step `killed`) and the
    chain's Lease has expired, gc records the chain `killed` (the step it was in killed,
    the next skipped), its record still valid, and nothing is left: no Job, Pod, Secret,
    Lease or mount."""
    assert fleet_settings.claim_root is not None
    wf = _chain(Path(fleet_settings.claim_root), {"hold": HOLD, "after": PICK})
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings, 'durability = "per-call"')
    second = kube_cluster.node_names[1]
    namespace = fleet_settings.namespace
    argv = ["run-workflow", str(wf), "--backend", "kubernetes", "--host-config", str(host)]
    with only_schedulable(kube_core, second, kube_cluster.node_names):
        proc = sandbox_cli(*argv, "--json")
        try:
            pod = step_running_on(kube_core, namespace, second)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
    try:
        assert guard_config_of(kube_core, namespace, pod).durability == "per-call"
        workflow_lease = lease.lease_name("wf")
        # The controller lives: gc leaves its chain, its step's Job and its Lease.
        report = _gc(fleet_settings)
        assert report.records_marked_killed == []
        assert _chain_record(wf).status is RunStatus.RUNNING
        assert client.BatchV1Api(kube_api).list_namespaced_job(namespace).items
        assert workflow_lease in leases_of(kube_api, namespace)

        proc.kill()  # SIGKILL: the controller cleans up nothing
        proc.communicate(timeout=60)
        # Its step's runner still runs (and renews the chain's Lease): left alone again.
        assert _gc(fleet_settings).records_marked_killed == []
        assert _chain_record(wf).status is RunStatus.RUNNING
        assert run_objects(kube_core, namespace)

        delete_jobs(kube_api, namespace)  # the step's Job, as an operator deletes it
        deadline = time.monotonic() + RUN_DEADLINE_S
        while _chain_record(wf).status is RunStatus.RUNNING:
            assert time.monotonic() < deadline, "gc never recorded the dead controller's chain"
            _gc(fleet_settings)
            time.sleep(1.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    chain = _chain_record(wf)
    assert chain.status is RunStatus.KILLED, chain.reason
    assert "the controller died in step hold" in chain.reason, chain.reason
    assert [e.status for e in chain.steps] == [StepState.KILLED, StepState.SKIPPED]
    step = read_record(the_run(wf) / Path(str(chain.steps[0].record)).parent)
    assert step.status is RunStatus.KILLED
    no_jobs_left(kube_api, namespace)
    no_pods_or_secrets(kube_core, namespace)
    while leases_of(kube_api, namespace):  # a Job's start mark goes with its Job
        assert time.monotonic() < deadline, leases_of(kube_api, namespace)
        time.sleep(0.2)
    assert not hostmount.mounts_below(wf)


AFTER = """\
import os, sqlite3
db = sqlite3.connect(os.environ["DB_PATH"])
db.execute("INSERT INTO t VALUES (4, 'after a dead runner')")
db.commit()
"""


def _namespace_objects(api: Any, namespace: str) -> set[str]:
    """What the namespace holds, by kind and name (the claims' volumes too)."""
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    listed = {
        "pod": core.list_namespaced_pod,
        "secret": core.list_namespaced_secret,
        "configmap": core.list_namespaced_config_map,
        "claim": core.list_namespaced_persistent_volume_claim,
        "service": core.list_namespaced_service,
        "job": batch.list_namespaced_job,
        "lease": client.CoordinationV1Api(api).list_namespaced_lease,
    }
    found = {
        f"{kind}/{x.metadata.name}" for kind, ls in listed.items() for x in ls(namespace).items
    }
    return found | {f"volume/{v.metadata.name}" for v in core.list_persistent_volume().items}


def test_a_chain_step_whose_runner_is_killed_ends_the_chain_killed_and_gc_leaves_nothing(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """SIGKILL to every process of a chain step's runner Pod (from the host, by its
    cgroup) while the step's own Pod runs: the runner cleans up nothing. The controller
    ends the chain `killed` (the step killed, its runner named; the next skipped), its
    record valid, and exits 1. The step's record stays `running` (unsealed) and the run's
    Pod outlives its runner until `sandbox gc` records the step `killed` and removes the
    run's Pod, Secret and node mounts and the Job: then nothing the run made is left,
    the real workflow is byte-identical, and a later chain on it passes."""
    assert fleet_settings.claim_root is not None
    wf = _chain(Path(fleet_settings.claim_root), {"hold": HOLD, "after": AFTER})
    real_db = (wf / "db" / "db.sqlite").read_bytes()
    before = tree_digest(wf)
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings)
    second = kube_cluster.node_names[1]
    namespace = fleet_settings.namespace
    operators = _namespace_objects(kube_api, namespace)
    argv = ["run-workflow", str(wf), "--backend", "kubernetes", "--host-config", str(host)]
    with only_schedulable(kube_core, second, kube_cluster.node_names):
        proc = sandbox_cli(*argv, "--json")
        try:
            step_running_on(kube_core, namespace, second)
            selector = f"{fleet.LABEL_FLEET}=true"
            (runner,) = kube_core.list_namespaced_pod(namespace, label_selector=selector).items
            victims = processes_of(runner.metadata.uid, 0)
            assert victims
            for victim in victims:
                victim.send_signal(signal.SIGKILL)
            out, err = proc.communicate(timeout=RUN_DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 1, (out, err)
    chain = WorkflowRunRecord.model_validate_json(out.splitlines()[-1])
    assert chain.status is RunStatus.KILLED, chain.reason
    assert "the runner of step hold died" in chain.reason, chain.reason
    assert [e.status for e in chain.steps] == [StepState.KILLED, StepState.SKIPPED]
    run_dir = the_run(wf)
    on_claim = validate(run_dir / "test_mode.json")  # the published JSON Schema's
    assert on_claim.status is RunStatus.KILLED and on_claim.finished_at is not None
    step_root = run_dir / Path(str(chain.steps[0].record)).parent
    assert read_record(step_root).status is RunStatus.RUNNING  # unsealed: gc's to record
    assert run_objects(kube_core, namespace)  # the run's Pod outlived its runner
    assert node_mounts_of(kube_cluster, second, chain.id)  # the step's disk and view

    report = _gc(fleet_settings)
    assert report.records_marked_killed == [str(step_root)]
    step = read_record(step_root)
    assert step.status is RunStatus.KILLED and "sandbox gc" in step.reason, step.reason
    assert _chain_record(wf).status is RunStatus.KILLED
    deadline = time.monotonic() + RUN_DEADLINE_S
    while (
        _namespace_objects(kube_api, namespace) != operators
        or node_mounts_of(kube_cluster, second, chain.id)
        or loops_of(chain.id)
    ):
        assert time.monotonic() < deadline, (
            _namespace_objects(kube_api, namespace) - operators,
            node_mounts_of(kube_cluster, second, chain.id),
            loops_of(chain.id),
        )
        time.sleep(0.2)
    assert not hostmount.mounts_below(wf)
    assert tree_digest(wf) == before
    assert (wf / "db" / "db.sqlite").read_bytes() == real_db

    # The workflow is free again: a later chain on it runs and passes.
    later = sandbox_cli(*argv, "--from", "after", "--json")
    out, err = later.communicate(timeout=RUN_DEADLINE_S)
    assert later.returncode == 0, (out, err)
    again = WorkflowRunRecord.model_validate_json(out.splitlines()[-1])
    assert again.status is RunStatus.PASSED, again.reason
    assert [(e.step_id, e.status) for e in again.steps] == [("after", StepState.PASSED)]
    assert tree_digest(wf) == before
    no_jobs_left(kube_api, namespace)
    no_pods_or_secrets(kube_core, namespace)


def test_a_chain_step_whose_runner_ends_before_its_record_ends_the_chain_killed_leaving_nothing(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """A chain step's runner Pod deleted before its runner began the step's record (as
    an eviction or a drain does; every node cordoned, so it never starts): the step did
    not run. The controller ends the chain `killed` (the step killed, the reason naming
    its runner and that the step did not run, no record named for it; the next skipped),
    its record valid, exits 1 and deletes the Job (any Pod it would make again with it).
    Nothing is left for `sandbox gc`: it records nothing, and no Pod, Secret, Job,
    Lease or node mount of the run remains; the real workflow is byte-identical."""
    assert fleet_settings.claim_root is not None
    wf = _chain(Path(fleet_settings.claim_root), {"hold": HOLD, "after": AFTER})
    real_db = (wf / "db" / "db.sqlite").read_bytes()
    before = tree_digest(wf)
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings)
    namespace = fleet_settings.namespace
    operators = _namespace_objects(kube_api, namespace)
    argv = ["run-workflow", str(wf), "--backend", "kubernetes", "--host-config", str(host)]
    selector = f"{fleet.LABEL_FLEET}=true"
    with only_schedulable(kube_core, "", kube_cluster.node_names):  # "": none is
        proc = sandbox_cli(*argv, "--json")
        try:
            deadline = time.monotonic() + RUN_DEADLINE_S
            while not (
                runners := kube_core.list_namespaced_pod(namespace, label_selector=selector).items
            ):
                assert time.monotonic() < deadline, "the step's runner Pod never came"
                time.sleep(0.2)
            (runner,) = runners
            assert runner.status.phase == "Pending" and not runner.spec.node_name
            kube_core.delete_namespaced_pod(runner.metadata.name, namespace)
            out, err = proc.communicate(timeout=RUN_DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 1, (out, err)
        no_jobs_left(kube_api, namespace)  # deleted by the controller, still cordoned
    chain = WorkflowRunRecord.model_validate_json(out.splitlines()[-1])
    assert chain.status is RunStatus.KILLED, chain.reason
    assert "the runner of step hold lost its Pod" in chain.reason, chain.reason
    assert "the step did not run" in chain.reason, chain.reason
    assert [e.status for e in chain.steps] == [StepState.KILLED, StepState.SKIPPED]
    assert chain.steps[0].record is None
    run_dir = the_run(wf)
    on_claim = validate(run_dir / "test_mode.json")  # the published JSON Schema's
    assert on_claim.status is RunStatus.KILLED and on_claim.finished_at is not None
    assert not list((run_dir / "steps").glob("*/test_mode.json"))

    assert _gc(fleet_settings).records_marked_killed == []
    deadline = time.monotonic() + RUN_DEADLINE_S
    while _namespace_objects(kube_api, namespace) != operators:
        assert time.monotonic() < deadline, _namespace_objects(kube_api, namespace) - operators
        time.sleep(0.2)
    for node in kube_cluster.node_names:
        assert not node_mounts_of(kube_cluster, node, chain.id)
    assert not loops_of(chain.id)
    assert not hostmount.mounts_below(wf)
    assert tree_digest(wf) == before
    assert (wf / "db" / "db.sqlite").read_bytes() == real_db
