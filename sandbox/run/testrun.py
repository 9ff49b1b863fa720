"""One test run of one step: prepare -> launch -> guard -> collect -> record.

`TestRun.execute()` is the whole product in one call. It takes the workflow's
exclusive lock and sequences the five phases, each in its own folder with a typed
result; `TestRun` only orders them, times them and tells `on_event` about them:

- prepare (`sandbox.prepare.plan`, `.rundir`): `runs/test-<id>/` made (copy of the
  newest real run's execution tree, VACUUM INTO copy of the DB, prompt with its TEST
  MODE section) -> `Prepared`;
- launch (`sandbox.launch.start`): the guard up with its firewall in, the step and MCP
  servers' containers started -> `Launched`;
- guard (`sandbox.collect.guarding`): the step runs under the guard, watched for a
  dead guard, a full disk and its timeout -> `Guarded`;
- collect (`sandbox.collect.harvest`): outputs, usage, file changes, DB diff and
  action summary read, every container gone -> `Collected`;
- record (`sandbox.record.finish`): the status and reason written into the record.

Containers are driven only through a `sandbox.backends.Backend` (Docker by
default). A record exists from the moment the run folder does; it says `running`
until the end, and `sandbox gc` turns it into `killed` if the runner died.
Containers, the watchers, the step's disk and its view of the workflow folder
(`sandbox.stepfs.lifecycle`) never outlive `execute()`: one `ExitStack` holds their
clean-up, and any error on the way still ends the record with a final status and
a reason naming the phase.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandbox.backends import Backend, BackendFactory
from sandbox.collect import harvest
from sandbox.collect.guarding import run_guarded
from sandbox.contracts.config import Step, StepRuntime
from sandbox.contracts.errors import ConfigError, PrepareError, SandboxError, internal_reason
from sandbox.contracts.events import REASON_CHARS, EventCallback, EventKind, RunEvent
from sandbox.contracts.hostconfig import load_host_config
from sandbox.contracts.layout import RunLayout, new_run_id
from sandbox.contracts.options import RunOptions
from sandbox.contracts.record import RunStatus, TestRunRecord, write_record
from sandbox.contracts.settings import STEP_RUNTIME_ENV, RunnerSettings, runner_settings
from sandbox.launch import start
from sandbox.launch.start import McpJobs
from sandbox.prepare import rundir
from sandbox.prepare.inputs import Seed, StepInputs, read_inputs
from sandbox.prepare.lock import LockHeldError, workflow_run_lock
from sandbox.prepare.plan import RunPlan, plan_run, stdio_servers, step_runtime_for, walls_for
from sandbox.record import finish
from sandbox.record.finish import runner_info
from sandbox.run.cancel import Cancel, RunInterrupted
from sandbox.stepfs import lifecycle as stepfs
from sandbox.stopsignals import HeldPool

if TYPE_CHECKING:
    from sandbox.contracts.wire import ActionLine

# The names callers know this module by; each is defined in its phase's module.
__all__ = [
    "STEP_RUNTIME_ENV",
    "RunInterrupted",
    "RunOptions",
    "Seed",
    "StepInputs",
    "TestRun",
    "execute_step",
    "host_backend",
    "internal_reason",
    "runner_info",
    "step_runtime_for",
]


@dataclass
class _Progress:
    """How far a run got, for its clean-up and for the reason of an unplanned error."""

    phase: str = "prepare"
    step_started: bool = False
    discard: bool = False  # a run that failed before its step started leaves only its record
    mcp_jobs: McpJobs = field(default_factory=dict)


def host_backend() -> Backend:
    """The default backend: the one the host's config names (Docker without one)."""
    from sandbox.backends.choose import connect_backend

    return connect_backend(load_host_config().backend)


class TestRun:
    """One step, once, in test mode."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        workflow_dir: Path,
        step_id: str,
        options: RunOptions | None = None,
        backend: BackendFactory | None = None,
    ):
        self.workflow_dir = Path(workflow_dir).absolute()
        self.step_id = step_id
        self.options = options or RunOptions()
        self._connect: BackendFactory = backend or host_backend
        # Shared with the chain's other steps when a `WorkflowRun` runs this one.
        self.stop = Cancel()

    # -- the whole flow ------------------------------------------------------

    def execute(self) -> TestRunRecord:
        """Run it. Raises SandboxError only before a run folder exists."""
        return self.execute_read(self.read_inputs())

    def execute_read(self, inputs: StepInputs) -> TestRunRecord:
        """`execute` with the inputs already read (`read_inputs`)."""
        # One backend per run, closed with it: its connections and threads must not
        # outlive the run (a caller running many runs in one process would pile them up).
        with contextlib.closing(self._connect()) as backend:
            return self._execute(backend, inputs)

    def cancel(self) -> None:
        """Stop the run from any thread: it ends `killed`, its record written and every
        container removed (`sandbox.run.cancel`). Returns once its step, if running, is
        killed; the run ends in its own thread (a run not yet started, as it starts)."""
        self.stop.request()

    def read_inputs(self) -> StepInputs:
        """Everything read from the workflow folder; a missing credential fails here,
        before any folder exists."""
        return read_inputs(self.workflow_dir, self.step_id)

    def _execute(self, backend: Backend, inputs: StepInputs) -> TestRunRecord:
        layout = RunLayout(self.workflow_dir, new_run_id(), inputs.step.group)
        record = self.new_record(backend, inputs, layout)
        try:
            lock = workflow_run_lock(
                self.workflow_dir, exclusive=True, owner=f"sandbox test run {layout.run_id}"
            )
        except LockHeldError as exc:
            rundir.make_run_root(layout)
            self._emit("step_start", record)
            return self._finish(layout, record, RunStatus.REFUSED, str(exc))

        with lock:
            # Looked up once, under the lock: the plan (DB_PATH, mounts) and the copy agree.
            seed = Seed.from_workflow(self.workflow_dir, inputs.step.group)
            rundir.make_run_root(layout)
            return self.run_held(backend, inputs, layout, record, seed)

    def new_record(
        self,
        backend: Backend,
        inputs: StepInputs,
        layout: RunLayout,
        *,
        workflow_run_id: str | None = None,
    ) -> TestRunRecord:
        """The run's first record (`running`); the images it needs must exist."""
        return finish.new_record(
            backend,
            self.workflow_dir,
            inputs,
            layout,
            self._step_runtime(inputs, runner_settings()),
            workflow_run_id=workflow_run_id,
        )

    def run_held(
        self,
        backend: Backend,
        inputs: StepInputs,
        layout: RunLayout,
        record: TestRunRecord,
        seed: Seed,
    ) -> TestRunRecord:
        """The five phases, in a run root that exists, under the workflow's exclusive
        lock that the caller holds (a single run, or a whole-workflow run for each of
        its steps). A Crew step is refused here: it never runs in test mode."""
        write_record(layout.root, record)
        self._emit("step_start", record)
        if inputs.step.kind == "crew":
            return self._finish(layout, record, RunStatus.REFUSED, _crew_reason(inputs.step))
        assert record.runner is not None
        step_runtime = self._step_runtime(inputs, runner_settings())
        ids = backend.id_map()
        record.walls = walls_for(self.options, inputs, step_runtime, ids)
        plan = plan_run(
            self.workflow_dir,
            self.options,
            inputs,
            layout,
            record.runner,
            has_db=seed.db is not None,
            ids=ids,
            step_runtime=step_runtime,
            test_run_id=record.workflow_run_id or layout.run_id,
        )
        return self._run_phases(backend, plan, seed, inputs.prompt, record)

    def _step_runtime(self, inputs: StepInputs, settings: RunnerSettings) -> StepRuntime:
        return step_runtime_for(inputs.workflow, self.options.step_runtime, settings)

    def _run_phases(
        self,
        backend: Backend,
        plan: RunPlan,
        seed: Seed,
        prompt: str | None,
        record: TestRunRecord,
    ) -> TestRunRecord:
        layout, workflow = plan.layout, plan.workflow
        files = stepfs.StepFs(layout, workflow.limits.disk_quota_mb * 1024**2)
        progress = _Progress()
        servers = stdio_servers(workflow)
        with contextlib.ExitStack() as cleanup:
            # Unwound last to first, on every way out: the watchers stop, every container
            # creation returns, the containers go, then the mounts, then what a run that
            # failed before its step started left.
            cleanup.callback(_discard_unstarted, layout, record, progress)
            cleanup.callback(
                lambda: harvest.close_files(layout, record, files, progress.step_started)
            )
            cleanup.callback(_quietly, backend.remove_all)
            cleanup.callback(harvest.collect_mcp_early, layout, record, progress.mcp_jobs)
            # The MCP servers' containers are created and started in these threads, beside
            # the guard's and the step's start; the run waits for them only once the step runs.
            mcp_pool = cleanup.enter_context(HeldPool(max_workers=max(1, len(servers))))
            # The step's disk, view and copies are made in this thread while the engine
            # creates and starts the guard's container (it mounts none of them); leaving
            # it waits for that work, before the containers and the mounts go.
            prepare_pool = cleanup.enter_context(HeldPool(max_workers=1))
            try:
                with self._phase(progress, record, "prepare", "prepare_s"):
                    rundir.prepare_guard(plan, record)
                    preparing = prepare_pool.submit(
                        self._prepare_step, backend, plan, files, seed, prompt, record
                    )
                with self._phase(progress, record, "launch", "container_start_s"):
                    harvest.warm_up()
                    start.start_mcp_servers(backend, plan, mcp_pool, progress.mcp_jobs, preparing)
                    guard, step, (prepared, prepare_step_s) = start.start_guard(
                        backend, plan, preparing
                    )
                    progress.step_started = True
                    self.stop.on_request(step.kill)  # a cancel ends the step's wait
                    mcp = start.started_mcp(progress.mcp_jobs)
                    launched = start.Launched(guard=guard, step=step, mcp=mcp)
                record.phases.prepare_s += prepare_step_s
                with self._phase(progress, record, "the step", "step_s"):
                    timeout_s = self.options.timeout_s or plan.step.timeout_s
                    on_action = None if self.options.on_event is None else self._on_action(record)
                    guarded = run_guarded(prepared, launched, cleanup, timeout_s, on_action)
                    record.exit_code = guarded.exit_code
                with self._phase(progress, record, "collect", "collect_s"):
                    collected = harvest.collect(backend, prepared, launched, guarded, record)
                self.stop.check()
                status, reason = finish.judged(record, plan, guarded, collected)
                return self._finish(layout, record, status, reason)
            except (RunInterrupted, KeyboardInterrupt):
                _prepare_ended(prepare_pool)
                return self._finish(layout, record, RunStatus.KILLED, self._stopped_reason())
            except Exception as exc:
                if not _prepare_ended(prepare_pool):
                    return self._finish(layout, record, RunStatus.KILLED, self._stopped_reason())
                if self.stop.requested:  # what the cancel's kill made fail is the cancel
                    return self._finish(layout, record, RunStatus.KILLED, self._stopped_reason())
                engine_failed = isinstance(exc, backend.engine_errors) and not isinstance(
                    exc, SandboxError
                )
                progress.discard = not progress.step_started and not engine_failed
                reason = _error_reason(backend, progress, exc)
                return self._finish(layout, record, RunStatus.ERROR, reason)

    @staticmethod
    def _prepare_step(
        backend: Backend,
        plan: RunPlan,
        files: stepfs.StepFs,
        seed: Seed,
        prompt: str | None,
        record: TestRunRecord,
    ) -> tuple[rundir.Prepared, float]:
        """`rundir.prepare_step` and the seconds it took (the record's prepare phase: it
        runs beside the launch); an error nobody planned for names the prepare, as it
        did in its own phase."""
        t0 = time.monotonic()
        try:
            prepared = rundir.prepare_step(plan, files, seed, prompt, record)
        except Exception as exc:
            if isinstance(exc, (SandboxError, *backend.engine_errors)):
                raise
            raise PrepareError(internal_reason("prepare", exc)) from exc
        return prepared, time.monotonic() - t0

    @contextlib.contextmanager
    def _phase(
        self, progress: _Progress, record: TestRunRecord, name: str, timing: str
    ) -> Iterator[None]:
        """Name the phase (for an unplanned error's reason) and time it into the record;
        a cancel asked by then stops the run before the phase starts."""
        self.stop.check()
        progress.phase = name
        t0 = time.monotonic()
        yield
        setattr(record.phases, timing, time.monotonic() - t0)

    def _stopped_reason(self) -> str:
        return "the run was cancelled" if self.stop.requested else "the runner was stopped"

    def _finish(
        self, layout: RunLayout, record: TestRunRecord, status: RunStatus, reason: str
    ) -> TestRunRecord:
        finish.finish(layout, record, status, reason)
        self._emit("step_end", record, status=status.value, duration_s=record.duration_s)
        return record

    # -- live progress -------------------------------------------------------------

    def _emit(self, kind: EventKind, record: TestRunRecord, **fields: Any) -> None:
        """One event to `on_event`, if given; whatever it raises stays out of the run."""
        callback = self.options.on_event
        if callback is None:
            return
        event = RunEvent(
            kind=kind, time=datetime.now(UTC), run_id=record.id, step_id=record.step_id, **fields
        )
        with contextlib.suppress(Exception):
            callback(event)

    def _on_action(self, record: TestRunRecord) -> Callable[[ActionLine], None]:
        def on_line(line: ActionLine) -> None:
            if line.event == "outcome":
                return  # a forwarded call counts once, at its start line
            self._emit(
                "action",
                record,
                decision=line.decision,
                tool=line.tool,
                reason=line.reason[:REASON_CHARS],
            )

        return on_line


def _error_reason(backend: Backend, progress: _Progress, exc: Exception) -> str:
    """Why an error ended the run: its own words, the engine's, or the phase it hit."""
    if isinstance(exc, backend.engine_errors) and not isinstance(exc, SandboxError):
        # The engine went away (stopped, restarted) mid-run: a record, never a traceback.
        detail = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        return f"the {backend.engine_label} failed during the run: {detail}"
    if isinstance(exc, SandboxError):
        return str(exc)
    # Whatever went wrong, the record ends with the phase and the error.
    return internal_reason(progress.phase, exc)


def _prepare_ended(pool: HeldPool) -> bool:
    """Wait for the step's side of the prepare (it fills the record, which is written
    once it no longer does); False when a stop came meanwhile (the run then ends
    `killed`, the stop acted on here rather than cutting the record's final write)."""
    try:
        pool.shutdown()
    except (RunInterrupted, KeyboardInterrupt):
        return False
    return True


def _discard_unstarted(layout: RunLayout, record: TestRunRecord, progress: _Progress) -> None:
    if progress.discard:
        start.discard_unstarted(layout, record)


def _crew_reason(step: Step) -> str:
    return (
        f"step {step.id} is a Crew step (crew {step.crew or '?'}): a Crew call acts in "
        "another project, so test mode refuses it; it did not run"
    )


def _quietly(action: Callable[[], None]) -> None:
    """A clean-up step whose failure must not stop the ones after it."""
    with contextlib.suppress(Exception):
        action()


def execute_step(
    workflow_dir: Path | str,
    step_id: str,
    test_mode: bool = True,
    *,
    on_event: EventCallback | None = None,
) -> TestRunRecord:
    """The public entry point the Builder and Pulse call; `on_event` gets the step's
    start, each guarded call as the guard logs it, and its end, while it runs."""
    if not test_mode:
        raise ConfigError("sandbox only runs steps in test mode (test_mode=True)")
    return TestRun(Path(workflow_dir), step_id, RunOptions(on_event=on_event)).execute()
