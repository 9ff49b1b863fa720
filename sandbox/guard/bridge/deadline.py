"""Time budgets for forwarded calls: `asyncio.timeout`'s behaviour with one loop timer
for all of a forwarder's calls instead of one per call.

At its deadline a call's task is cancelled and the cancel comes out of the `with` as
`TimeoutError`; a cancel from elsewhere (the client left, the guard stops) stays a
`CancelledError`, counted as asyncio counts it (`Task.cancelling`/`uncancel`). A call
that ends in time costs a set entry: the timer is armed for the earliest deadline and
left armed when that call ends early; when it fires, it cancels the calls past theirs
and is armed for the next one. Every forwarded call pays this, which is why it is not
`asyncio.timeout` (a timer armed and cancelled per call, ~27k instructions).
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType


class Deadlines:
    """The pending deadlines of one forwarder, on the loop that runs its calls."""

    def __init__(self) -> None:
        self._pending: set[Deadline] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._armed_for = math.inf  # when the timer fires (inf: not armed)

    def within(self, delay: float) -> Deadline:
        """A `with` block that the current task must leave within `delay` seconds.
        The deadline counts from this call: use it only as `with deadlines.within(...)`."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a deadline holds only inside a task")
        when = loop.time() + delay
        deadline = Deadline(self, task, when, task.cancelling())
        self._pending.add(deadline)
        if when < self._armed_for or loop is not self._timer_loop:
            self._arm(loop, when)
        return deadline

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._fire)
        self._timer_loop = loop
        self._armed_for = when

    def _fire(self) -> None:
        loop = self._timer_loop
        assert loop is not None
        # The timer fired for `_armed_for`: a deadline at or before it has passed even if
        # the loop's clock reads a hair earlier (timers are kept in milliseconds).
        now = max(loop.time(), self._armed_for)
        self._timer = None
        self._armed_for = math.inf
        earliest = math.inf
        for deadline in list(self._pending):
            if deadline.when <= now:
                self._pending.discard(deadline)
                deadline.expire()
            elif deadline.when < earliest:
                earliest = deadline.when
        if earliest < math.inf:
            self._arm(loop, earliest)


class Deadline:
    """One call's deadline (`Deadlines.within`), a synchronous context manager: entering
    and leaving it awaits nothing."""

    __slots__ = ("_cancelling", "_expired", "_owner", "_task", "when")

    def __init__(
        self, owner: Deadlines, task: asyncio.Task[object], when: float, cancelling: int
    ) -> None:
        self._owner = owner
        self._task = task
        self.when = when
        self._cancelling = cancelling  # the task's cancel requests when the block began
        self._expired = False

    def __enter__(self) -> Deadline:
        return self

    def expire(self) -> None:
        self._expired = True
        self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._owner._pending.discard(self)  # inline: every forwarded call passes here
        # As asyncio.timeout's exit: the cancel this deadline made is taken back, and
        # turned into TimeoutError when no other cancel is pending.
        if (
            self._expired
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc
