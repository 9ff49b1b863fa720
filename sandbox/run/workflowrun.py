"""A whole workflow in test mode: its steps as one chain, each step's effects flowing on.

`WorkflowRun.execute()` prepares once for the chain and then runs each step's own
phases (`TestRun.run_held`: prepare its disk, launch, guard, collect, record):

- one `runs/test-<id>/` folder, the workflow's exclusive lock held from the first
  step to the last, its record (`WorkflowRunRecord`) there from the start;
- one DB copy carried step to step: the first step's is a VACUUM INTO copy of the
  real DB, each later step's a copy of the one the step before it left, so step 2
  reads what step 1 changed;
- each group folder seeded once from the newest real run, then carrying what the
  earlier steps of the chain wrote into it;
- per step a fresh disk, guard and step container (nothing of one step's guard,
  processes or /tmp reaches the next, only the group folders and the DB copy), its
  own run root under `steps/`, the prompt's TEST MODE section and
  `AGENTWORKS_TEST_MODE=1` as in any test run.

A step that does not pass stops the chain (the rest recorded `skipped`, with the
reason) unless `keep_going`; a Crew step is refused, which fails the chain; a stopped
runner (SIGTERM) ends the record `killed`, and a runner killed outright leaves it
`running` with `current_step` naming the step it was in (`sandbox gc` records it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandbox.backends import BackendFactory
from sandbox.collect import dbdiff, stubgroups
from sandbox.contracts.config import Step, Workflow, load_workflow
from sandbox.contracts.errors import ConfigError, RefusedError, SandboxError
from sandbox.contracts.events import EventCallback, EventKind, RunEvent
from sandbox.contracts.layout import RunLayout, WorkflowRunLayout, make_private_dir, new_run_id
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.contracts.version import runner_version
from sandbox.contracts.workflow_record import (
    ChainStep,
    ChainTotals,
    StepState,
    WorkflowRunRecord,
    write_workflow_record,
)
from sandbox.prepare.copytree import newest_real_run
from sandbox.prepare.dbcopy import find_workflow_db
from sandbox.prepare.lock import workflow_run_lock
from sandbox.run.cancel import Cancel, RunInterrupted
from sandbox.run.testrun import (
    RunOptions,
    Seed,
    StepInputs,
    TestRun,
    host_backend,
    internal_reason,
    runner_info,
)

# Worst first: the chain's status is the worst of its steps'.
_SEVERITY = {
    RunStatus.KILLED: 4,
    RunStatus.ERROR: 3,
    RunStatus.FAILED: 2,
    RunStatus.TIMEOUT: 2,
    RunStatus.QUOTA: 2,
    RunStatus.REFUSED: 2,
    RunStatus.PASSED: 0,
}


@dataclass(frozen=True)
class WorkflowOptions:
    """Which part of the chain runs, and what a failing step does to the rest.

    `step` is every step's run options (timeout, upstream networks, `on_event`)."""

    from_step: str | None = None
    to_step: str | None = None
    keep_going: bool = False
    step: RunOptions = field(default_factory=RunOptions)


@dataclass(frozen=True)
class StepPlace:
    """Where a chain's step runs: its place in the chain and its run root there."""

    index: int  # 1-based
    total: int
    step: Step
    layout: RunLayout
    chain_id: str  # the chain's run id


# The step's run began (its run id, when): the chain's record names it.
StepStarted = Callable[[str, datetime], None]
# One step of the chain, run in its place from its seed, to its sealed record: on this
# host (`WorkflowRun`), or in a runner Job the scheduler places (`sandbox.run.fleetchain`).
StepRunner = Callable[[StepPlace, Seed, StepStarted], TestRunRecord]


@dataclass(frozen=True)
class ChainInputs:
    """What a chain reads before any folder exists (`WorkflowRun.read_inputs`)."""

    workflow: Workflow
    chain: list[Step]
    runs: list[TestRun]
    inputs: list[StepInputs]


def chain_of(workflow: Workflow, from_step: str | None, to_step: str | None) -> list[Step]:
    """The steps a run takes: the workflow's order, from `from_step` to `to_step`
    (both included). An unknown name, or a `to_step` before `from_step`, is a
    ConfigError."""
    order = workflow.order()
    ids = [s.id for s in order]
    start = ids.index(workflow.step(from_step).id) if from_step else 0
    end = ids.index(workflow.step(to_step).id) if to_step else len(ids) - 1
    if end < start:
        raise ConfigError(
            f"--to {to_step} comes before --from {from_step} in this workflow's order "
            f"({' -> '.join(ids)})"
        )
    return order[start : end + 1]


class WorkflowRun:
    """A workflow's steps, once, as one test run."""

    def __init__(
        self,
        workflow_dir: Path,
        options: WorkflowOptions | None = None,
        backend: BackendFactory | None = None,
    ):
        self.workflow_dir = Path(workflow_dir).absolute()
        self.options = options or WorkflowOptions()
        self._connect: BackendFactory = backend or host_backend
        self.stop = Cancel()  # every step's too

    def execute(self) -> WorkflowRunRecord:
        """Run the chain. Raises SandboxError only before a run folder exists (a bad
        config, an unknown step, a missing credential)."""
        return self.execute_read(self.read_inputs())

    def read_inputs(self) -> ChainInputs:
        """The workflow, its chain and each step's inputs; a bad config, an unknown step
        or a missing credential fails here, before any folder exists."""
        if self.options.step.replay is not None:
            raise ConfigError(
                "a workflow run does not replay; replay one step's run with "
                "`sandbox run WORKFLOW_DIR STEP --replay RUN`"
            )
        workflow = load_workflow(self.workflow_dir)
        chain = chain_of(workflow, self.options.from_step, self.options.to_step)
        runs = [
            TestRun(self.workflow_dir, s.id, self._step_options(i, len(chain)))
            for i, s in enumerate(chain, 1)
        ]
        for run in runs:
            run.stop = self.stop
        return ChainInputs(workflow, chain, runs, [run.read_inputs() for run in runs])

    def execute_read(self, read: ChainInputs) -> WorkflowRunRecord:
        """`execute` with the inputs already read (`read_inputs`)."""
        with contextlib.closing(self._connect()) as backend:

            def run_step(place: StepPlace, seed: Seed, started: StepStarted) -> TestRunRecord:
                run, inputs = read.runs[place.index - 1], read.inputs[place.index - 1]
                step_record = run.new_record(
                    backend, inputs, place.layout, workflow_run_id=place.chain_id
                )
                started(step_record.id, step_record.started_at)
                return run.run_held(backend, inputs, place.layout, step_record, seed)

            return self._execute(read.workflow, read.chain, run_step)

    def cancel(self) -> None:
        """Stop the chain from any thread: the step it is in ends `killed` (its
        containers removed), the rest are skipped, and the chain's record says
        `killed` (`TestRun.cancel`)."""
        self.stop.request()

    def _step_options(self, index: int, total: int) -> RunOptions:
        """Each step's options: its events carry its place in the chain."""
        callback = self.options.step.on_event
        if callback is None:
            return self.options.step

        def on_event(event: RunEvent) -> None:
            callback(event.model_copy(update={"index": index, "total": total}))

        return dataclasses.replace(self.options.step, on_event=on_event)

    def _lock(self, layout: WorkflowRunLayout) -> contextlib.AbstractContextManager[object]:
        """The workflow's exclusive lock, held from the first step to the last; raises
        RefusedError (naming the holder) when another run holds it."""
        return workflow_run_lock(
            self.workflow_dir, exclusive=True, owner=f"sandbox workflow test run {layout.run_id}"
        )

    def _execute(
        self, workflow: Workflow, chain: list[Step], run_step: StepRunner
    ) -> WorkflowRunRecord:
        layout = WorkflowRunLayout(self.workflow_dir, new_run_id())
        record = WorkflowRunRecord(
            runner_version=runner_version(),
            id=layout.run_id,
            workflow_dir=str(self.workflow_dir),
            workflow_name=workflow.name,
            status=RunStatus.RUNNING,
            order=[s.id for s in workflow.order()],
            from_step=self.options.from_step,
            to_step=self.options.to_step,
            keep_going=self.options.keep_going,
            started_at=datetime.now(UTC),
            runner=runner_info(),
            steps=[ChainStep(index=i, step_id=s.id, group=s.group) for i, s in enumerate(chain, 1)],
        )
        try:
            lock = self._lock(layout)
        except RefusedError as exc:
            self._make_root(layout)
            return self._finish(layout, record, RunStatus.REFUSED, str(exc), skip=str(exc))
        with lock:
            self._make_root(layout)
            write_workflow_record(layout.root, record)
            self._emit("workflow_start", record, total=len(chain))
            try:
                return self._run_chain(layout, record, chain, run_step)
            except (RunInterrupted, KeyboardInterrupt) as exc:
                why = str(exc) or (
                    "the run was cancelled" if self.stop.requested else "the runner was stopped"
                )
                return self._end_early(layout, record, RunStatus.KILLED, why)
            except SandboxError as exc:
                return self._end_early(layout, record, RunStatus.ERROR, str(exc))
            except Exception as exc:
                return self._end_early(
                    layout, record, RunStatus.ERROR, internal_reason("the chain", exc)
                )

    def _end_early(
        self, layout: WorkflowRunLayout, record: WorkflowRunRecord, status: RunStatus, why: str
    ) -> WorkflowRunRecord:
        """The chain ends where it is: the step it was in (if any) ends with it."""
        if record.current_step is not None:
            entry = record.step_entry(record.current_step)
            if entry.status is StepState.RUNNING:
                entry.status, entry.reason = StepState(status.value), why
            if entry.record and not os.path.lexists(layout.root / entry.record):
                entry.record = None  # its runner ended before it began it
        return self._finish(layout, record, status, why, skip=why)

    def _make_root(self, layout: WorkflowRunLayout) -> None:
        runs = layout.runs_dir
        if runs.is_symlink():
            raise ConfigError(f"{runs} is a symlink; refusing to create a test run through it")
        runs.mkdir(exist_ok=True)
        make_private_dir(layout.root)
        make_private_dir(layout.steps_dir)

    def _run_chain(
        self,
        layout: WorkflowRunLayout,
        record: WorkflowRunRecord,
        chain: list[Step],
        run_step: StepRunner,
    ) -> WorkflowRunRecord:
        # Looked up once, under the lock; what each step leaves is carried from then on.
        carried_db = find_workflow_db(self.workflow_dir)
        carried_groups: dict[str, Path | None] = {}
        first_baseline: Path | None = None
        stopped = ""  # why the rest of the chain does not run
        for index, step in enumerate(chain, 1):
            entry = record.steps[index - 1]
            if stopped:
                entry.status, entry.reason = StepState.SKIPPED, stopped
                continue
            self.stop.check()
            step_layout = layout.step(index, step.id, step.group)
            if step.group not in carried_groups:
                carried_groups[step.group] = newest_real_run(self.workflow_dir, step.group)
            seed = Seed(group=carried_groups[step.group], db=carried_db)
            make_private_dir(step_layout.root)

            def started(
                run_id: str,
                at: datetime,
                entry: ChainStep = entry,
                path: str = str(step_layout.record.relative_to(layout.root)),
            ) -> None:
                """The step's run began: the chain's record names it before it runs."""
                entry.status, entry.run_id = StepState.RUNNING, run_id
                entry.record = path
                entry.started_at = at
                record.current_step = entry.step_id
                write_workflow_record(layout.root, record)

            place = StepPlace(index, len(chain), step, step_layout, layout.run_id)
            step_record = run_step(place, seed, started)
            _fold(entry, step_record)
            record.stubbed, record.stubbed_cut = stubgroups.merge(
                (e.step_id, e.stubbed, e.stubbed_cut) for e in record.steps
            )
            synced = _append_lines(step_layout.actions, layout.actions)
            record.log_synced_at = synced or record.log_synced_at
            # What the step left is what the next step of its group, and every later
            # step's DB copy, starts from (a step that never started left nothing).
            if _is_dir(step_layout.group_dir):
                carried_groups[step.group] = step_layout.group_dir
                record.groups[step.group] = str(step_layout.group_dir.relative_to(layout.root))
            if not step_record.no_db and _is_file(step_layout.db_path):
                carried_db = step_layout.db_path
                record.db = str(step_layout.db_path.relative_to(layout.root))
                if first_baseline is None and _is_file(step_layout.baseline_db):
                    first_baseline = step_layout.baseline_db
            if step_record.status is RunStatus.KILLED:
                raise RunInterrupted()  # the runner was stopped in this step: so is the chain
            record.current_step = None
            write_workflow_record(layout.root, record)
            if step_record.status is not RunStatus.PASSED and not self.options.keep_going:
                stopped = f"step {step.id} did not pass ({step_record.status.value})"
        if first_baseline is not None and carried_db is not None:
            # The real DB (as the first step's copy was made) against the copy at the end.
            record.db_diff = dbdiff.diff_databases(first_baseline, carried_db, work_dir=layout.root)
        status, reason = _chain_verdict(record)
        return self._finish(layout, record, status, reason)

    def _finish(
        self,
        layout: WorkflowRunLayout,
        record: WorkflowRunRecord,
        status: RunStatus,
        reason: str,
        *,
        skip: str = "",
    ) -> WorkflowRunRecord:
        for entry in record.steps:
            if entry.status is StepState.PENDING:
                entry.status, entry.reason = StepState.SKIPPED, skip or "not reached"
        record.status, record.reason = status, reason
        record.finished_at = datetime.now(UTC)
        record.duration_s = (record.finished_at - record.started_at).total_seconds()
        record.totals = _totals(record)
        write_workflow_record(layout.root, record)
        self._emit("workflow_end", record, status=status.value, duration_s=record.duration_s)
        return record

    def _emit(self, kind: EventKind, record: WorkflowRunRecord, **fields: Any) -> None:
        callback = self.options.step.on_event
        if callback is None:
            return
        event = RunEvent(kind=kind, time=datetime.now(UTC), run_id=record.id, **fields)
        with contextlib.suppress(Exception):
            callback(event)


def _fold(entry: ChainStep, step: TestRunRecord) -> None:
    """A step's own record, summed up in its chain entry."""
    entry.status = StepState(step.status.value)
    entry.reason = step.reason
    entry.finished_at = step.finished_at
    entry.duration_s = step.duration_s
    entry.exit_code = step.exit_code
    entry.phases = step.phases
    entry.stubbed = list(step.stubbed)
    entry.stubbed_cut = step.stubbed_cut
    entry.actions = step.actions
    entry.db_diff = step.db_diff
    entry.files = step.files
    entry.log_synced_at = step.log_synced_at


def _chain_verdict(record: WorkflowRunRecord) -> tuple[RunStatus, str]:
    """The worst step's status, and the first step with it as the reason."""
    ran = [e for e in record.steps if e.status not in (StepState.SKIPPED, StepState.PENDING)]
    worst = max(
        (RunStatus(e.status.value) for e in ran), key=lambda s: _SEVERITY.get(s, 2), default=None
    )
    if worst is None or worst is RunStatus.PASSED:
        return RunStatus.PASSED, ""
    failed = (RunStatus.REFUSED, RunStatus.TIMEOUT, RunStatus.QUOTA)
    chain_status = RunStatus.FAILED if worst in failed else worst
    first = next(e for e in ran if _SEVERITY.get(RunStatus(e.status.value), 2) == _SEVERITY[worst])
    return chain_status, f"step {first.step_id} {first.status.value}: {first.reason}"


def _totals(record: WorkflowRunRecord) -> ChainTotals:
    totals = ChainTotals(steps=len(record.steps), duration_s=record.duration_s)
    for entry in record.steps:
        if entry.status is StepState.PASSED:
            totals.passed += 1
        elif entry.status is StepState.SKIPPED:
            totals.skipped += 1
        elif entry.status is not StepState.PENDING:
            totals.failed += 1
        for decision in ("allow", "stub", "redirect", "refuse"):
            setattr(totals, decision, getattr(totals, decision) + getattr(entry.actions, decision))
        totals.files_created += len(entry.files.created)
        totals.files_changed += len(entry.files.changed)
        totals.files_deleted += len(entry.files.deleted)
    return totals


def _is_dir(path: Path) -> bool:
    with contextlib.suppress(OSError):
        return os.path.isdir(path) and not os.path.islink(path)
    return False


def _is_file(path: Path) -> bool:
    with contextlib.suppress(OSError):
        return os.path.isfile(path) and not os.path.islink(path)
    return False


def _append_lines(src: Path, dst: Path) -> datetime | None:
    """A step's action log onto the chain's (the guard wrote it; nothing is followed),
    synced; when it was (None: the step left no log)."""
    try:
        src_fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        dst_fd = os.open(
            dst, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        try:
            for chunk in _chunks(src_fd):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(dst_fd, view) :]
            os.fsync(dst_fd)
            return datetime.now(UTC)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def _chunks(fd: int, size: int = 1024 * 1024) -> Iterator[bytes]:
    while chunk := os.read(fd, size):
        yield chunk


def execute_workflow(
    workflow_dir: Path | str,
    *,
    test_mode: bool = True,
    from_step: str | None = None,
    to_step: str | None = None,
    keep_going: bool = False,
    options: RunOptions | None = None,
    on_event: EventCallback | None = None,
) -> WorkflowRunRecord:
    """The public entry point for a whole workflow (`run_full_workflow(test_mode=True)`).

    `options` go to every step; `on_event` gets the chain's and each step's events
    (start, each guarded call as the guard logs it, end) while it runs."""
    if not test_mode:
        raise ConfigError("sandbox only runs workflows in test mode (test_mode=True)")
    options = options or RunOptions()
    if on_event is not None:
        options = dataclasses.replace(options, on_event=on_event)
    return WorkflowRun(
        Path(workflow_dir),
        WorkflowOptions(
            from_step=from_step,
            to_step=to_step,
            keep_going=keep_going,
            step=options,
        ),
    ).execute()
