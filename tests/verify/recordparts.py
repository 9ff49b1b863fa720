"""Run folders as the runner leaves them, made without the engine: one step's run
(its record and its sealed action log) and a whole-workflow chain of them. A helper,
not a test module, so no test file imports another."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandbox.collect.actionsummary import read as summarize
from sandbox.contracts.layout import WorkflowRunLayout
from sandbox.contracts.record import ACTIONS_FILE, RunStatus, TestRunRecord, write_record
from sandbox.contracts.workflow_record import (
    ChainStep,
    StepState,
    WorkflowRunRecord,
    write_workflow_record,
)
from tests.collect.logparts import write_log

SUBMIT = ("upwork_submit_proposal", "stub", {"job_id": 42, "connects": 16})


def finished_run(
    root: Path, calls: list[tuple[str, str, dict[str, Any]]] | None = None, **fields: Any
) -> Path:
    """A run folder as the runner leaves it: its record and its sealed action log."""
    root.mkdir(parents=True)
    (root / "g").mkdir()
    write_log(root / ACTIONS_FILE, [SUBMIT] if calls is None else calls)
    now = datetime.now(UTC)
    summary = summarize(root / ACTIONS_FILE)
    base: dict[str, Any] = {
        "stubbed": summary.stubbed,
        "actions": summary.counts,
        "id": root.name,
        "workflow_dir": str(root.parent.parent),
        "workflow_name": "wf",
        "step_id": "s",
        "group": "g",
        "command": "true",
        "status": RunStatus.PASSED,
        "exit_code": 0,
        "started_at": now,
        "log_synced_at": now,
        "no_db": True,
    }
    write_record(root, TestRunRecord(**(base | fields)))
    return root


PICK = ("query_workflow_db", "redirect", {"sql": "UPDATE jobs SET claimed = 1"})
CLICK = ("agent_browser", "stub", {"command": "click #submit"})
SLACK = ("send_slack_message", "stub", {"channel": "@dana", "text": "hi"})

Calls = list[tuple[str, str, dict[str, Any]]]


def finished_chain(
    wf: Path,
    run_id: str,
    steps: list[tuple[str, Calls | None]],
    *,
    sealed: bool = True,
    **fields: Any,
) -> Path:
    """A whole-workflow run folder as the runner leaves it: the chain's record and each
    step's run (None: the step was skipped, it has no run)."""
    layout = WorkflowRunLayout(wf, run_id)
    now = datetime.now(UTC)
    entries = []
    for index, (step_id, calls) in enumerate(steps, start=1):
        entry = ChainStep(index=index, step_id=step_id, group="g", status=StepState.SKIPPED)
        if calls is not None:
            root = layout.step(index, step_id, "g").root
            finished_run(root, calls, step_id=step_id)
            entry.status, entry.run_id, entry.log_synced_at = StepState.PASSED, root.name, now
        entries.append(entry)
    record = WorkflowRunRecord(
        id=run_id,
        workflow_dir=str(wf),
        workflow_name="job-board",
        status=RunStatus.PASSED,
        started_at=now,
        order=[s for s, _ in steps],
        steps=entries,
        log_synced_at=now if sealed else None,
        **fields,
    )
    write_workflow_record(layout.root, record)
    return layout.root


def chain(wf: Path, run_id: str, connects: int = 16, **kw: Any) -> Path:
    submit = (SUBMIT[0], SUBMIT[1], SUBMIT[2] | {"connects": connects})
    steps: list[tuple[str, Calls | None]] = [
        ("bid-pick-job", [PICK]),
        ("bid-submit", [submit, CLICK]),
        ("outreach", [SLACK]),
    ]
    return finished_chain(wf, run_id, kw.pop("steps", steps), **kw)
