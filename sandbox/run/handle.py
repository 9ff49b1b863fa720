"""A run started in the background: `start_step` and `start_workflow` return a `RunHandle`.

The one-call functions (`execute_step`, `execute_workflow`) block until the record
exists; a controller that shows progress, or must stop a run from another thread
(a user's "stop" button, a deadline of its own), takes a handle instead:

- `events()` iterates the run's `RunEvent`s as they happen and ends when the run
  does; every call starts from the first event, so several readers in several
  threads each see all of them;
- `cancel()` stops the run from any thread (`sandbox.run.cancel`): it ends `killed`,
  its record written and every container removed;
- `wait(timeout)` returns the record once the run ended (or re-raises what stopped
  it before a run folder existed); `record` is the record once done, else None.

What can be refused before a run folder exists (a bad config, an unknown step, a
missing credential) raises from `start_*` itself, as from the one-call functions.
The run's thread is not a daemon: a program that exits leaves no run half-done.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

from sandbox.backends import BackendFactory
from sandbox.contracts.events import EventCallback, RunEvent
from sandbox.contracts.options import RunOptions
from sandbox.contracts.record import TestRunRecord
from sandbox.contracts.workflow_record import WorkflowRunRecord
from sandbox.run.testrun import TestRun
from sandbox.run.workflowrun import WorkflowOptions, WorkflowRun

R = TypeVar("R", TestRunRecord, WorkflowRunRecord)


class _EventLog:
    """Every event of one run, kept in order; readers wait for the next or the end."""

    def __init__(self) -> None:
        self._events: list[RunEvent] = []
        self._closed = False
        self._changed = threading.Condition()

    def add(self, event: RunEvent) -> None:
        with self._changed:
            self._events.append(event)
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def follow(self) -> Iterator[RunEvent]:
        seen = 0
        while True:
            with self._changed:
                while seen == len(self._events) and not self._closed:
                    self._changed.wait()
                if seen == len(self._events):
                    return
                event = self._events[seen]
            seen += 1
            yield event


class RunHandle(Generic[R]):
    """One run going on in its own thread; see the module docstring.

    As a context manager, leaving the block cancels the run if it still goes on and
    waits for its end, so nothing outlives the block."""

    def __init__(
        self, execute: Callable[[], R], cancel: Callable[[], None], log: _EventLog, name: str
    ) -> None:
        self._cancel = cancel
        self._log = log
        self._done = threading.Event()
        self._record: R | None = None
        self._error: BaseException | None = None

        def target() -> None:
            try:
                self._record = execute()
            except BaseException as exc:  # handed to whoever waits
                self._error = exc
            finally:
                self._log.close()
                self._done.set()

        self._thread = threading.Thread(target=target, name=name)
        self._thread.start()

    def events(self) -> Iterator[RunEvent]:
        """The run's events, from its first, as they happen; ends when the run ends."""
        return self._log.follow()

    def cancel(self) -> None:
        """Stop the run (from any thread); `wait()` then returns its `killed` record.
        A run already ended is left as it ended."""
        if not self._done.is_set():
            self._cancel()

    def done(self) -> bool:
        """Whether the run ended (its record is final)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> R:
        """The final record; `TimeoutError` if the run still goes on after `timeout`
        seconds (None: wait as long as it takes)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the run still goes on after {timeout} s")
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._record is not None
        return self._record

    @property
    def record(self) -> R | None:
        """The final record once the run ended; None while it goes on (or if it raised)."""
        return self._record if self._done.is_set() else None

    def __enter__(self) -> RunHandle[R]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()
        self._done.wait()
        self._thread.join()


def _tee(log: _EventLog, theirs: EventCallback | None) -> EventCallback:
    """The handle's log first, then the caller's own `on_event`, if any."""
    if theirs is None:
        return log.add

    def both(event: RunEvent) -> None:
        log.add(event)
        theirs(event)

    return both


def start_step(
    workflow_dir: Path | str,
    step_id: str,
    options: RunOptions | None = None,
    *,
    backend: BackendFactory | None = None,
) -> RunHandle[TestRunRecord]:
    """Start one step's test run in the background (`TestRun`) and return its handle.

    `options.on_event`, if given, is called too (on the runner's threads)."""
    options = options or RunOptions()
    log = _EventLog()
    options = dataclasses.replace(options, on_event=_tee(log, options.on_event))
    run = TestRun(Path(workflow_dir), step_id, options, backend)
    inputs = run.read_inputs()
    return RunHandle(lambda: run.execute_read(inputs), run.cancel, log, f"sandbox run {step_id}")


def start_workflow(
    workflow_dir: Path | str,
    options: WorkflowOptions | None = None,
    *,
    backend: BackendFactory | None = None,
) -> RunHandle[WorkflowRunRecord]:
    """Start a whole workflow's test run in the background (`WorkflowRun`) and return
    its handle; its events are the chain's and each step's."""
    options = options or WorkflowOptions()
    log = _EventLog()
    step = dataclasses.replace(options.step, on_event=_tee(log, options.step.on_event))
    run = WorkflowRun(Path(workflow_dir), dataclasses.replace(options, step=step), backend)
    read = run.read_inputs()
    return RunHandle(
        lambda: run.execute_read(read), run.cancel, log, f"sandbox run-workflow {workflow_dir}"
    )
