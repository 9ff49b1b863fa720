"""The guard phase on the runner's side: the step runs under its guard until it exits
or its timeout hits, watched for a dead guard and a full disk.

Either of those kills the step at once; the watchers it starts are stopped by the
run's clean-up stack on every way out, and by the collect phase on the planned one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sandbox.backends import ContainerState, ExitWatcher, UsageWatcher
from sandbox.launch.start import Launched
from sandbox.prepare.rundir import Prepared
from sandbox.stopsignals import HeldPool

if TYPE_CHECKING:
    # The action lines' models: read only by `--follow` (and the collect), so a run
    # loads them beside the guard's start (`sandbox.collect.harvest.warm_up`), not before.
    from sandbox.collect.follow import ActionFollower
    from sandbox.contracts.wire import ActionLine


@dataclass(frozen=True)
class Guarded:
    """The step's end under the guard: its exit code, None when its timeout hit."""

    exit_code: int | None
    timeout_s: float
    exit_watch: ExitWatcher  # the guard's: cancelled before the runner stops the guard
    usage: UsageWatcher  # the step's: finished once the step is dead
    follower: ActionFollower | None  # the action log's, with `on_event`: drained at collect
    # The guard's state when the step's output ended, and its stop then (`_stop_guard`);
    # None (or a result of None) when the collect reads and stops it.
    guard_stop: concurrent.futures.Future[ContainerState | None] | None = None


def run_guarded(
    prepared: Prepared,
    launched: Launched,
    cleanup: contextlib.ExitStack,
    timeout_s: float,
    on_action: Callable[[ActionLine], None] | None,
) -> Guarded:
    """The step runs under its guard until it exits or `timeout_s` hits; a dead guard
    or a full disk kills it at once. The watchers' stops are held by `cleanup`; each
    line the guard logs goes to `on_action`, when given."""
    step = launched.step
    # Started after the step, so a guard already dead kills a step that runs.
    exit_watch = launched.guard.watch_exit(on_exit=step.kill)
    cleanup.callback(exit_watch.cancel)
    prepared.files.watch(on_full=lambda _usage: step.kill())
    usage = step.watch_usage()
    cleanup.callback(usage.finish)
    follower = None
    if on_action is not None:
        from sandbox.collect.follow import ActionFollower

        follower = ActionFollower(prepared.plan.layout.actions, on_action)
        cleanup.callback(follower.start().stop)
    # The guard's stop begins once the step's output has ended (its last process is
    # gone), beside the engine's teardown of the step's container that its wait waits
    # for; leaving the pool waits for the stop on every way out (the wake comes first).
    output_ended, wake = threading.Event(), threading.Event()
    pool = cleanup.enter_context(HeldPool(max_workers=1, thread_name_prefix="guard-stop"))
    cleanup.callback(wake.set)
    guard_stop = None

    def ended() -> None:
        output_ended.set()
        wake.set()

    if step.on_output_end(ended):
        guard_stop = pool.submit(_stop_guard, launched, exit_watch, output_ended, wake)
    try:
        exit_code = step.wait(timeout_s)
    finally:
        wake.set()  # an output that has not ended by now leaves the stop to the collect
    if exit_code is None:
        step.kill()
    return Guarded(
        exit_code=exit_code,
        timeout_s=timeout_s,
        exit_watch=exit_watch,
        usage=usage,
        follower=follower,
        guard_stop=guard_stop,
    )


def _stop_guard(
    launched: Launched,
    exit_watch: ExitWatcher,
    output_ended: threading.Event,
    wake: threading.Event,
) -> ContainerState | None:
    """Once woken: if the step's output ended, the guard's state (was it still up when
    the step ended?) and then its stop; None when the step's wait returned first (the
    collect then does both)."""
    wake.wait()
    if not output_ended.is_set():
        return None
    exit_watch.cancel()  # the guard's stop is not a dead guard
    state = launched.guard.state()
    launched.guard.stop()
    return state
