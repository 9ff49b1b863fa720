"""The record of a whole-workflow test run (`runs/test-<id>/test_mode.json`, `kind: workflow`).

A chain of steps runs as one test run; each step is a test run of its own under
`steps/` with its own `TestRunRecord`, and this record sums them up: per step its
status, phases, stubbed actions, DB diff and file changes, the chain's totals, and
the stubbed actions of the whole chain first. It exists from the moment the run
folder does and says `running` (and which step runs, `current_step`) until the end,
so a runner killed mid-chain leaves a record that names the step it was in;
`sandbox gc` turns it into `killed`. It changes only with a new `schema_version` and
a regenerated JSON Schema (`sandbox/contracts/test_mode_workflow.schema.json`).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sandbox.contracts.defaults import empty_list
from sandbox.contracts.record import (
    ACTIONS_FILE,
    RECORD_FILE,
    SCHEMA_VERSION,
    ActionCounts,
    FileChanges,
    Phases,
    RunnerInfo,
    RunStatus,
    StubbedAction,
    StubbedCut,
    TestRunRecord,
    stubbed_lines,
    write_json_atomic,
)
from sandbox.contracts.reports import DbDiff

WORKFLOW_SCHEMA_PATH = Path(__file__).parent / "test_mode_workflow.schema.json"


# Built on first use: a single step's run imports this module (for the chain's summary
# type) and never validates any of these; their build is CPU every `sandbox run` start
# would pay before its first container.
_DEFERRED = ConfigDict(defer_build=True)


class StepState(StrEnum):
    """A chain step's state: a run status once it ran, else pending or skipped."""

    PENDING = "pending"
    SKIPPED = "skipped"
    RUNNING = "running"
    PASSED = "passed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    REFUSED = "refused"
    ERROR = "error"
    KILLED = "killed"
    QUOTA = "quota"


class ChainStubbedAction(StubbedAction):
    """One line of the chain's opening summary: every stubbed call of one tool across
    the chain. `step_id` made the first call (`first_line` is in its action log),
    `last_step_id` the last (`last_line`), `steps` counts the calls per step. A record
    written before the grouping holds one entry per call of one step."""

    model_config = _DEFERRED

    step_id: str = Field(
        description=("The step that made the first call (`first_line` is in its action log).")
    )
    last_step_id: str = Field(
        default="", description="The step that made the last call (`last_line`)."
    )
    steps: dict[str, int] = Field(default_factory=dict, description="Calls per step.")


class ChainStep(BaseModel):
    """One step of the chain, as its own record says (`record`, relative to the run root)."""

    model_config = _DEFERRED

    index: int = Field(description="The step's place in the chain, from 1.")
    step_id: str = Field(description="The step.")
    group: str = Field(description="Its group folder.")
    status: StepState = Field(
        default=StepState.PENDING,
        description=("Its state: a run status once it ran, else `pending` or `skipped`."),
    )
    reason: str = Field(default="", description="Why it ended so (or was skipped).")
    run_id: str | None = Field(default=None, description="Its own test run's id.")
    record: str | None = Field(
        default=None, description="Its own record, relative to the chain's run folder."
    )
    started_at: datetime | None = Field(default=None, description="When it started.")
    finished_at: datetime | None = Field(default=None, description="When it ended.")
    duration_s: float | None = Field(default=None, description="Its wall time.")
    exit_code: int | None = Field(default=None, description="The step's exit code.")
    phases: Phases = Field(default_factory=Phases, description="Seconds per phase.")
    stubbed: list[StubbedAction] = Field(
        default_factory=empty_list, description="Its stubbed calls, grouped by tool."
    )
    stubbed_cut: StubbedCut = Field(
        default_factory=StubbedCut, description="What a cap left out of `stubbed`."
    )
    actions: ActionCounts = Field(
        default_factory=ActionCounts, description="Its guarded calls per decision."
    )
    db_diff: DbDiff | None = Field(
        default=None, description="Its DB diff: the copy it got against the copy it left."
    )
    files: FileChanges = Field(
        default_factory=FileChanges, description="What it did to its group folder."
    )
    log_synced_at: datetime | None = Field(
        default=None, description="Its own record's seal (see the record's `log_synced_at`)."
    )  # the step's own record's seal


class ChainTotals(BaseModel):
    """The chain summed up: steps by state, guarded calls by decision."""

    model_config = _DEFERRED

    steps: int = Field(default=0, description="Steps in the chain.")
    passed: int = Field(default=0, description="Steps that passed.")
    failed: int = Field(
        default=0,
        description=("Steps that did not pass (failed, timeout, error, killed, quota, refused)."),
    )
    skipped: int = Field(default=0, description="Steps skipped.")
    allow: int = Field(default=0, description="Calls allowed, all steps.")
    stub: int = Field(default=0, description="Calls stubbed, all steps.")
    redirect: int = Field(default=0, description="Calls redirected, all steps.")
    refuse: int = Field(default=0, description="Calls refused, all steps.")
    files_created: int = Field(default=0, description="Files created, all steps.")
    files_changed: int = Field(default=0, description="Files changed, all steps.")
    files_deleted: int = Field(default=0, description="Files deleted, all steps.")
    duration_s: float | None = Field(default=None, description="The chain's wall time.")


class WorkflowRunRecord(BaseModel):
    """`runs/test-<id>/test_mode.json` of a whole-workflow test run."""

    model_config = ConfigDict(title="WorkflowRunRecord", defer_build=True)

    schema_version: Literal[1] = Field(
        default=SCHEMA_VERSION, description="The record's schema version."
    )
    kind: Literal["workflow"] = Field(
        default="workflow", description="Always `workflow`: a whole-workflow record."
    )
    test_mode: Literal[True] = Field(default=True, description="Always true.")
    runner_version: str | None = Field(
        default=None,
        description=("The sandbox version that wrote the record (null: before it was recorded)."),
    )
    id: str = Field(description="The chain's test run id (`runs/test-<id>/`).")
    workflow_dir: str = Field(description="The workflow folder.")
    workflow_name: str = Field(description="The workflow's name.")
    status: RunStatus = Field(
        description=("How the chain ended: its worst step's status (`running` while it runs).")
    )
    reason: str = Field(default="", description="Why it ended so.")
    # Every stubbed tool of the chain, grouped, in the order of its first call.
    stubbed: list[ChainStubbedAction] = Field(
        default_factory=empty_list,
        description=("Every stubbed tool of the chain, grouped, in the order of its first call."),
    )
    stubbed_cut: StubbedCut = Field(
        default_factory=StubbedCut, description="What a cap left out of `stubbed`."
    )
    current_step: str | None = Field(
        default=None, description="The step running now (kept when the runner died in it)."
    )  # the step running now (kept when the runner died in it)
    order: list[str] = Field(
        default_factory=empty_list, description="The workflow's whole step order."
    )  # the workflow's whole order
    from_step: str | None = Field(default=None, description="`--from`: the first step run.")
    to_step: str | None = Field(default=None, description="`--to`: the last step run.")
    keep_going: bool = Field(
        default=False, description="`--keep-going`: steps after a failure ran anyway."
    )
    started_at: datetime = Field(description="When the chain started.")
    finished_at: datetime | None = Field(default=None, description="When it ended.")
    duration_s: float | None = Field(default=None, description="Its wall time.")
    totals: ChainTotals = Field(default_factory=ChainTotals, description="The chain summed up.")
    # The real DB against the DB copy as the chain left it (None: no DB, or no step ran).
    db_diff: DbDiff | None = Field(
        default=None,
        description=("The real DB against the copy the chain left (null: no DB, or no step ran)."),
    )
    # Where each group folder and the DB copy ended (relative to the run root).
    groups: dict[str, str] = Field(
        default_factory=dict,
        description="Where each group folder ended, relative to the run folder.",
    )
    db: str | None = Field(
        default=None, description="Where the DB copy ended, relative to the run folder."
    )
    steps: list[ChainStep] = Field(
        default_factory=empty_list, description="Each step of the chain."
    )
    actions_log: str = Field(
        default=ACTIONS_FILE,
        description=("The chain's action log file name: every step's lines in order."),
    )
    # When the runner last synced the chain's action log (after each step's lines went
    # onto it); None: not sealed, and a verification refuses the chain.
    log_synced_at: datetime | None = Field(
        default=None,
        description=(
            "When the runner last synced the chain's action log; null: not "
            "sealed, and a verification refuses the chain."
        ),
    )
    runner: RunnerInfo | None = Field(default=None, description="Who ran the chain.")

    def step_entry(self, step_id: str) -> ChainStep:
        return next(s for s in self.steps if s.step_id == step_id)

    def summary_lines(self) -> list[str]:
        """Every stubbed action of the chain first, then each step's verdict."""
        lines = [f"workflow test run {self.id}: {self.workflow_name} {self.status.value}"]
        unlogged = sum(e.actions.stubbed_unlogged or 0 for e in self.steps)
        stubs = sum(e.actions.stub for e in self.steps)
        lines += stubbed_lines(self.stubbed, self.stubbed_cut, stubs, unlogged or None)
        for entry in self.steps:
            took = f" ({entry.duration_s:.1f} s)" if entry.duration_s is not None else ""
            lines.append(
                f"step {entry.index} {entry.step_id}: {entry.status.value}{took}"
                + (f": {entry.reason}" if entry.reason else "")
            )
        t = self.totals
        lines.append(
            f"steps: {t.passed} passed, {t.failed} failed, {t.skipped} skipped of {t.steps}; "
            f"guarded calls: {t.allow} allowed, {t.redirect} redirected, {t.stub} stubbed, "
            f"{t.refuse} refused"
        )
        if self.db_diff is not None:
            lines.extend(f"db: {line}" for line in self.db_diff.summary_lines())
        if self.reason:
            lines.append(f"reason: {self.reason}")
        return lines


AnyRecord = TestRunRecord | WorkflowRunRecord


def write_workflow_record(run_root: Path, record: WorkflowRunRecord) -> Path:
    path = run_root / RECORD_FILE
    write_json_atomic(path, record.model_dump_json(indent=2) + "\n")
    return path


def read_any_record(run_root: Path) -> AnyRecord:
    """A test run's record, of one step or of a whole workflow (never through a link)."""
    fd = os.open(run_root / RECORD_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, encoding="utf-8") as handle:
        text = handle.read()
    data = json.loads(text)
    if isinstance(data, dict) and data.get("kind") == "workflow":
        return WorkflowRunRecord.model_validate(data)
    return TestRunRecord.model_validate(data)


def workflow_record_json_schema() -> str:
    """The published schema text; a test pins the committed file to it."""
    return json.dumps(WorkflowRunRecord.model_json_schema(), indent=2, sort_keys=True) + "\n"
