"""A whole workflow in test mode, on the real engine: one test run, effects flowing step to step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from docker import DockerClient

from sandbox.backends.docker import gc
from sandbox.contracts.events import RunEvent
from sandbox.contracts.record import RunStatus, read_record
from sandbox.contracts.reports import DbDiff
from sandbox.contracts.wire import ActionLine
from sandbox.contracts.workflow_record import (
    StepState,
    WorkflowRunRecord,
)
from sandbox.prepare.lock import LockHeldError, workflow_run_lock
from sandbox.run.testrun import RunOptions
from sandbox.run.workflowrun import WorkflowOptions, WorkflowRun, execute_workflow
from tests import paths
from tests.conftest import containers_of, tree_digest
from tests.scenarios.workflowparts import chain_workflow, the_run, validate

pytestmark = pytest.mark.engine

REPO = paths.REPO
T = TypeVar("T")

# A step that says which test run, step and step run its environment names.
SAY_IDS = """\
ids = [os.environ[f"AGENTWORKS_TEST_{k}"] for k in ("RUN_ID", "STEP_ID", "STEP_RUN_ID")]
print("IDS", *ids)
"""

WAIT_FOR_GO = """\
end = time.monotonic() + 120
while not pathlib.Path("go").exists():
    assert time.monotonic() < end, "the test never said go"
    time.sleep(0.05)
"""

PICK = """\
db.execute("INSERT INTO t VALUES (2, 'claimed by pick')")
db.commit()
pathlib.Path("note.txt").write_text("from pick")
assert agentworks_bridge.call("notify_user", {"text": "picked"})["decision"] == "stub"
"""

SUBMIT = """\
row = db.execute("SELECT v FROM t WHERE id = 2").fetchone()
assert row == ("claimed by pick",), row
assert pathlib.Path("note.txt").read_text() == "from pick"
assert pathlib.Path("earlier.txt").read_text() == "real run"
pathlib.Path("proposal.txt").write_text("submitted")
assert agentworks_bridge.call("send_message", {"to": "x", "text": "hi"})["decision"] == "stub"
"""

ANNOUNCE = """\
assert db.execute("SELECT v FROM t WHERE id = 2").fetchone() == ("claimed by pick",)
assert not pathlib.Path("note.txt").exists()  # another group's folder
"""


def inserted(diff: DbDiff | None) -> int:
    assert diff is not None and diff.error is None, diff
    return sum(table.inserted for table in diff.tables if table.name == "t")


def wait_for(
    predicate: Callable[[], T | None], what: str, alive: Callable[[], bool], deadline_s: float = 120
) -> T:
    """Poll until `predicate` finds it, while the run is still `alive`."""
    end = time.monotonic() + deadline_s
    while True:
        found = predicate()
        if found:
            return found
        assert alive(), f"the run ended before {what}"
        assert time.monotonic() < end, f"{what} never happened"
        time.sleep(0.05)


def test_the_chain_carries_the_db_copy_and_group_folders_and_leaves_the_real_ones_alone(
    engine: DockerClient, tmp_path: Path
) -> None:
    wf = chain_workflow(
        tmp_path,
        [
            ("pick", "g", PICK + SAY_IDS),
            ("submit", "g", SUBMIT + SAY_IDS),
            ("announce", "h", ANNOUNCE + SAY_IDS),
        ],
    )
    before = tree_digest(wf)
    events: list[RunEvent] = []
    record = execute_workflow(wf, on_event=events.append)
    assert record.status is RunStatus.PASSED, record.summary_lines()
    assert tree_digest(wf) == before  # the real folder and DB, byte for byte

    root = the_run(wf)  # one run folder for the whole chain
    assert validate(root / "test_mode.json") == record
    assert [(s.step_id, s.status) for s in record.steps] == [
        ("pick", StepState.PASSED),
        ("submit", StepState.PASSED),
        ("announce", StepState.PASSED),
    ]
    # Each step is a test run of its own: its own record, run id and (fresh) guard.
    step_records = [read_record((root / (s.record or "")).parent) for s in record.steps]
    assert len({r.id for r in step_records}) == 3
    assert all(r.workflow_run_id == record.id for r in step_records)
    # One test run: every step's AGENTWORKS_TEST_RUN_ID is the chain's; its own step and
    # step run are named beside it.
    for step_record in step_records:
        assert f"IDS {record.id} {step_record.step_id} {step_record.id}" in step_record.stdout.text
    # The chain's stubbed actions come first, each naming its step.
    assert [(a.step_id, a.tool) for a in record.stubbed] == [
        ("pick", "notify_user"),
        ("submit", "send_message"),
    ]
    assert record.summary_lines()[1].startswith("2 call(s) were stubbed")
    assert record.totals.passed == 3 and record.totals.stub == 2
    # The action log of the chain has every step's lines, each naming its step.
    lines = [
        ActionLine.model_validate_json(raw)
        for raw in (root / record.actions_log).read_text().splitlines()
    ]
    assert {line.step for line in lines} == {"pick", "submit"}
    # Per-step DB diffs, and the chain's against the real DB.
    assert inserted(record.steps[0].db_diff) == 1
    assert inserted(record.steps[1].db_diff) == 0
    assert inserted(record.db_diff) == 1
    assert record.steps[1].files.created == ["proposal.txt"]
    assert (root / record.groups["g"] / "proposal.txt").read_text() == "submitted"
    # Events: the chain's start, each step's start, its stubs and its end, in order.
    kinds = [(e.kind, e.step_id) for e in events if e.kind != "action"]
    assert kinds[0] == ("workflow_start", "") and kinds[-1] == ("workflow_end", "")
    assert [e.tool for e in events if e.kind == "action"] == ["notify_user", "send_message"]
    assert [(e.index, e.total) for e in events if e.kind == "step_end"] == [(1, 3), (2, 3), (3, 3)]


def test_the_lock_is_held_from_the_first_step_to_the_last(
    engine: DockerClient, tmp_path: Path
) -> None:
    wf = chain_workflow(tmp_path, [("one", "g", ""), ("two", "g", WAIT_FOR_GO), ("three", "g", "")])
    result: list[WorkflowRunRecord] = []
    seen: list[RunEvent] = []
    options = WorkflowOptions(step=RunOptions(on_event=seen.append))
    thread = threading.Thread(target=lambda: result.append(WorkflowRun(wf, options).execute()))
    thread.start()
    try:
        group = wait_for(
            lambda: next((wf / "runs").glob("test-*/steps/2-two/.disk/group"), None),
            "step two's disk",
            alive=thread.is_alive,
        )
        # Step one is over and step two runs: nothing else may start in this workshop.
        assert ("step_end", "one") in [(e.kind, e.step_id) for e in seen]
        with pytest.raises(LockHeldError):
            workflow_run_lock(wf, exclusive=False, owner="a real run").__enter__()
        (group / "go").write_text("")
    finally:
        thread.join(timeout=240)
    (record,) = result
    assert record.status is RunStatus.PASSED, record.summary_lines()
    with workflow_run_lock(wf, exclusive=False, owner="a real run"):
        pass


def test_a_failing_middle_step_stops_the_chain_unless_keep_going(
    engine: DockerClient, tmp_path: Path
) -> None:
    wf = chain_workflow(
        tmp_path, [("one", "g", ""), ("two", "g", "raise SystemExit(3)\n"), ("three", "g", "")]
    )
    record = WorkflowRun(wf).execute()
    assert record.status is RunStatus.FAILED
    assert [s.status for s in record.steps] == [
        StepState.PASSED,
        StepState.FAILED,
        StepState.SKIPPED,
    ]
    assert record.steps[2].reason == "step two did not pass (failed)"
    assert record.steps[2].run_id is None  # it never started
    assert "step two failed" in record.reason
    assert validate(the_run(wf) / "test_mode.json").status is RunStatus.FAILED

    kept = WorkflowRun(wf, WorkflowOptions(keep_going=True)).execute()
    assert kept.status is RunStatus.FAILED
    assert [s.status for s in kept.steps] == [StepState.PASSED, StepState.FAILED, StepState.PASSED]


def test_a_crew_step_is_refused_and_fails_the_chain(engine: DockerClient, tmp_path: Path) -> None:
    crew = '\n[[steps]]\nid = "ask-crew"\ngroup = "g"\nkind = "crew"\ncrew = "other"\n'
    wf = chain_workflow(tmp_path, [("one", "g", "")], extra=crew)
    record = WorkflowRun(wf).execute()
    assert record.status is RunStatus.FAILED
    assert [s.status for s in record.steps] == [StepState.PASSED, StepState.REFUSED]
    assert "Crew step" in record.steps[1].reason
    assert (
        read_record((the_run(wf) / (record.steps[1].record or "")).parent).status
        is RunStatus.REFUSED
    )


def sandbox_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sandbox.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )


def test_run_workflow_from_to_runs_only_that_part(engine: DockerClient, tmp_path: Path) -> None:
    wf = chain_workflow(tmp_path, [("a", "g", ""), ("b", "g", ""), ("c", "g", ""), ("d", "g", "")])
    proc = sandbox_cli("run-workflow", str(wf), "--from", "b", "--to", "c", "--json")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    record = WorkflowRunRecord.model_validate_json(out)
    assert [s.step_id for s in record.steps] == ["b", "c"]
    assert record.order == ["a", "b", "c", "d"] and (record.from_step, record.to_step) == ("b", "c")
    assert sorted(p.name for p in (the_run(wf) / "steps").iterdir()) == ["1-b", "2-c"]
    listed = subprocess.run(
        [sys.executable, "-m", "sandbox.cli", "list", str(wf)], capture_output=True, text=True
    )
    assert f"{record.id}  [workflow test run]  b -> c  passed" in listed.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "sandbox.cli", "show", str(the_run(wf))],
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0 and "step 1 b: passed" in shown.stdout


def test_follow_prints_a_stub_while_the_step_still_runs(
    engine: DockerClient, tmp_path: Path
) -> None:
    body = 'assert agentworks_bridge.call("notify_user", {"text": "x"})["decision"] == "stub"\n'
    wf = chain_workflow(tmp_path, [("step1", "g", body + WAIT_FOR_GO)])
    proc = sandbox_cli("run", str(wf), "step1", "--follow")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "stub" in line and "notify_user" in line:
                break
        else:
            pytest.fail(f"no stub line; stderr: {proc.stderr.read() if proc.stderr else ''}")
        # Read while it runs: the step has not ended, its record still says so.
        assert proc.poll() is None
        (root,) = (wf / "runs").glob("test-*")
        assert read_record(root).status is RunStatus.RUNNING
        (root / ".disk" / "group" / "go").write_text("")
        rest = proc.stdout.read()
        assert proc.wait(timeout=120) == 0, rest
        assert "[step1] step passed" in rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


def test_follow_json_lines_of_a_workflow_run(engine: DockerClient, tmp_path: Path) -> None:
    wf = chain_workflow(tmp_path, [("pick", "g", PICK), ("submit", "g", SUBMIT)])
    proc = sandbox_cli("run-workflow", str(wf), "--follow", "--json")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    *event_lines, last = out.splitlines()
    events = [RunEvent.model_validate_json(line) for line in event_lines]
    assert [e.kind for e in events][:2] == ["workflow_start", "step_start"]
    assert [(e.step_id, e.decision, e.tool) for e in events if e.kind == "action"] == [
        ("pick", "stub", "notify_user"),
        ("submit", "stub", "send_message"),
    ]
    assert WorkflowRunRecord.model_validate_json(last).status is RunStatus.PASSED


def test_a_runner_killed_mid_chain_leaves_a_valid_record_naming_its_step(
    engine: DockerClient, tmp_path: Path
) -> None:
    wf = chain_workflow(tmp_path, [("one", "g", ""), ("two", "g", WAIT_FOR_GO), ("three", "g", "")])
    proc = sandbox_cli("run-workflow", str(wf))
    try:
        wait_for(
            lambda: next((wf / "runs").glob("test-*/steps/2-two/.disk/group"), None),
            "step two's disk",
            alive=lambda: proc.poll() is None,
        )
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    root = the_run(wf)
    record = validate(root / "test_mode.json")
    assert record.status is RunStatus.RUNNING and record.current_step == "two"
    assert [s.status for s in record.steps] == [
        StepState.PASSED,
        StepState.RUNNING,
        StepState.PENDING,
    ]

    report = gc.collect(engine, [wf])
    assert str(root) in report.records_marked_killed
    record = validate(root / "test_mode.json")
    assert record.status is RunStatus.KILLED and "step two" in record.reason
    assert [s.status for s in record.steps] == [
        StepState.PASSED,
        StepState.KILLED,
        StepState.SKIPPED,
    ]
    assert read_record(root / "steps" / "2-two").status is RunStatus.KILLED
    assert not containers_of(engine, wf, all=True)
    assert not list(root.glob("steps/*/.disk"))


def test_a_workflow_run_is_refused_while_another_run_holds_the_workshop(
    engine: DockerClient, tmp_path: Path
) -> None:
    wf = chain_workflow(tmp_path, [("one", "g", ""), ("two", "g", "")])
    with workflow_run_lock(wf, exclusive=False, owner="a real run"):
        record = WorkflowRun(wf).execute()
    assert record.status is RunStatus.REFUSED and "a real run" in record.reason
    assert [s.status for s in record.steps] == [StepState.SKIPPED, StepState.SKIPPED]
    assert validate(the_run(wf) / "test_mode.json") == record
    assert not list((the_run(wf) / "steps").iterdir())


def test_a_stopped_runner_ends_the_chain_killed_in_its_step(
    engine: DockerClient, tmp_path: Path
) -> None:
    wf = chain_workflow(tmp_path, [("one", "g", ""), ("two", "g", WAIT_FOR_GO), ("three", "g", "")])
    proc = sandbox_cli("run-workflow", str(wf))
    try:
        wait_for(
            lambda: next((wf / "runs").glob("test-*/steps/2-two/.disk/group"), None),
            "step two's disk",
            alive=lambda: proc.poll() is None,
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130  # interrupted
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    record = validate(the_run(wf) / "test_mode.json")
    assert record.status is RunStatus.KILLED and record.current_step == "two"
    assert [s.status for s in record.steps] == [
        StepState.PASSED,
        StepState.KILLED,
        StepState.SKIPPED,
    ]
    assert record.steps[2].reason == "the runner was stopped"
    assert not containers_of(engine, wf, all=True)
