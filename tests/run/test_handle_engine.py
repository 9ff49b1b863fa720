"""The run handle (`sandbox.start_step`, `sandbox.start_workflow`) on the real engine: events
while the run goes on, a cancel from another thread that ends the run `killed` with its
record written and no container left, and `wait` returning the record."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema
import pytest
from docker import DockerClient

import sandbox
from sandbox.contracts.layout import RunLayout
from sandbox.contracts.names import LABEL_MANAGED, LABEL_RUN_ID
from sandbox.contracts.record import SCHEMA_PATH, read_record
from sandbox.contracts.workflow_record import StepState
from tests.conftest import WorkflowFactory, containers_of, tree_digest
from tests.scenarios.workflowparts import chain_workflow, the_run, validate

pytestmark = pytest.mark.engine

# A stubbed call the guard logs, then a step that would go on for as long as its timeout.
CALL_THEN_HANG = """\
import time, agentworks_bridge as b
b.call("upwork_submit_proposal", {"job_id": 42, "text": "hire me"})
while True:
    time.sleep(0.05)
"""


def _hanging_workflow(make_workflow: WorkflowFactory) -> Path:
    wf = make_workflow(command="python3 /workflow/code/step.py", timeout_s=600)
    (wf / "code" / "step.py").write_text(CALL_THEN_HANG)
    return wf


def _containers_of_run(engine: DockerClient, run_id: str) -> list[str]:
    """Every container, running or not, labelled with the run's id (`docker ps -a`)."""
    found = engine.containers.list(
        all=True,
        filters={"label": [LABEL_MANAGED, f"{LABEL_RUN_ID}={run_id}"]},
        ignore_removed=True,
    )
    return [str(c.name) for c in found]


def _cancel_from_another_thread(handle: sandbox.RunHandle[sandbox.TestRunRecord]) -> None:
    canceller = threading.Thread(target=handle.cancel)
    canceller.start()
    canceller.join(timeout=120)
    assert not canceller.is_alive(), "cancel() never returned"


def test_events_arrive_as_the_step_runs_and_a_cancel_from_another_thread_ends_it_killed(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = _hanging_workflow(make_workflow)
    before = tree_digest(wf)
    with sandbox.start_step(wf, "step1") as handle:
        seen = []
        for event in handle.events():
            seen.append(event)
            if event.kind == "action":
                break  # the guard logged the call; the step still runs
        assert [e.kind for e in seen] == ["step_start", "action"]
        assert (seen[1].decision, seen[1].tool) == ("stub", "upwork_submit_proposal")
        assert not handle.done() and handle.record is None
        with pytest.raises(TimeoutError):
            handle.wait(timeout=0)
        run_id = seen[0].run_id
        assert _containers_of_run(engine, run_id), "the step's containers run"

        _cancel_from_another_thread(handle)
        record = handle.wait(timeout=180)

    assert record.status is sandbox.RunStatus.KILLED, record.reason
    assert record.reason == "the run was cancelled"
    assert handle.record is record
    # The events end with the run, and a reader that comes late sees them all.
    events = list(handle.events())
    assert events[: len(seen)] == seen
    assert (events[-1].kind, events[-1].status) == ("step_end", "killed")
    # The record on disk is the final one, valid against the published schema.
    root = wf / "runs" / record.id
    data = json.loads((root / "test_mode.json").read_text())
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    assert read_record(root) == record
    assert record.finished_at is not None
    # What the guard logged before the cancel is kept.
    actions = RunLayout(wf, record.id, "g").actions.read_text()
    assert "upwork_submit_proposal" in actions
    assert _containers_of_run(engine, run_id) == []
    assert not containers_of(engine, wf, all=True)
    assert tree_digest(wf) == before


def test_a_cancel_before_the_step_starts_ends_the_run_killed_with_nothing_left(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = _hanging_workflow(make_workflow)
    handle = sandbox.start_step(wf, "step1")
    handle.cancel()
    record = handle.wait(timeout=180)
    assert record.status is sandbox.RunStatus.KILLED, record.reason
    assert read_record(wf / "runs" / record.id).status is sandbox.RunStatus.KILLED
    assert _containers_of_run(engine, record.id) == []


def test_wait_returns_the_record_and_the_callers_own_callback_still_hears(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command="echo done > done.txt", db_sql=None)
    heard: list[sandbox.RunEvent] = []
    handle = sandbox.start_step(wf, "step1", sandbox.RunOptions(on_event=heard.append))
    record = handle.wait(timeout=300)
    assert record.status is sandbox.RunStatus.PASSED, record.reason
    assert handle.done() and handle.record is record
    assert read_record(wf / "runs" / record.id) == record
    events = list(handle.events())
    assert [e.kind for e in events] == ["step_start", "step_end"] and events == heard
    handle.cancel()  # too late: the run is left as it ended
    assert handle.wait(timeout=0).status is sandbox.RunStatus.PASSED


def test_what_is_refused_before_a_run_folder_exists_raises_from_start(
    make_workflow: WorkflowFactory,
) -> None:
    wf = make_workflow(command="true", db_sql=None)
    with pytest.raises(sandbox.ConfigError, match="unknown step 'nope'"):
        sandbox.start_step(wf, "nope")
    with pytest.raises(sandbox.ConfigError, match="unknown step 'nope'"):
        sandbox.start_workflow(wf, sandbox.WorkflowOptions(from_step="nope"))
    assert not (wf / "runs").exists()


def test_a_workflow_cancelled_mid_chain_ends_killed_in_its_step(
    engine: DockerClient, tmp_path: Path
) -> None:
    hang = 'agentworks_bridge.call("notify_user", {"text": "two"})\nwhile True:\n    time.sleep(0.05)\n'
    wf = chain_workflow(tmp_path, [("one", "g", ""), ("two", "g", hang), ("three", "g", "")])
    with sandbox.start_workflow(wf) as handle:
        for event in handle.events():
            if event.kind == "action" and event.step_id == "two":
                break
        assert not handle.done()
        threading.Thread(target=handle.cancel).start()
        record = handle.wait(timeout=180)
    assert record.status is sandbox.RunStatus.KILLED and record.current_step == "two"
    assert [s.status for s in record.steps] == [
        StepState.PASSED,
        StepState.KILLED,
        StepState.SKIPPED,
    ]
    assert record.reason == "the run was cancelled"
    assert validate(the_run(wf) / "test_mode.json") == record
    kinds = [(e.kind, e.step_id, e.status) for e in handle.events()]
    assert kinds[-2:] == [("step_end", "two", "killed"), ("workflow_end", "", "killed")]
    assert not containers_of(engine, wf, all=True)
