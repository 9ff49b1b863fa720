"""The guard phase on the runner's side: the step runs under its guard until it exits
or its timeout hits, watched for a dead guard and a full disk.

Either of those kills the step at once; the watchers it starts are stopped by the
run's clean-up stack on every way out, and by the collect phase on the planned one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sandbox.backends import ExitWatcher, UsageWatcher
from sandbox.launch.start import Launched
from sandbox.prepare.rundir import Prepared

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
    exit_code = step.wait(timeout_s)
    if exit_code is None:
        step.kill()
    return Guarded(
        exit_code=exit_code,
        timeout_s=timeout_s,
        exit_watch=exit_watch,
        usage=usage,
        follower=follower,
    )
