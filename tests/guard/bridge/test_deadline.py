"""A forwarded call's time budget ends it as `asyncio.timeout` would: TimeoutError at
its own deadline, an outer cancel left a cancel, nothing cancelled after the call left
in time; and a forwarder's calls share one loop timer."""

from __future__ import annotations

import asyncio

import pytest

from sandbox.guard.bridge.deadline import Deadlines
from tests.guard.bridge.bridgeparts import TimerCountingLoop

NEVER = 3600.0  # a budget no test waits for


async def _hang(deadlines: Deadlines, budget: float) -> None:
    with deadlines.within(budget):
        await asyncio.Event().wait()


def test_a_call_past_its_budget_ends_with_timeout_error_and_its_cancel_taken_back() -> None:
    async def main() -> int:
        deadlines = Deadlines()
        with pytest.raises(TimeoutError):
            await _hang(deadlines, 0.05)
        task = asyncio.current_task()
        assert task is not None
        await asyncio.sleep(0)  # still running: the cancel was this deadline's only
        return task.cancelling()

    assert asyncio.run(main()) == 0


def test_each_call_ends_at_its_own_deadline_and_the_others_go_on() -> None:
    async def main() -> None:
        deadlines = Deadlines()
        release = asyncio.Event()

        async def long() -> str:
            with deadlines.within(NEVER):
                await release.wait()
            return "done"

        first = asyncio.create_task(long())  # arms the timer far ahead
        await asyncio.sleep(0)
        with pytest.raises(TimeoutError):  # a shorter one after it still ends on time
            await _hang(deadlines, 0.05)
        with pytest.raises(TimeoutError):  # and another after the timer fired
            await _hang(deadlines, 0.05)
        assert not first.done()
        release.set()
        assert await first == "done"

    asyncio.run(main())


def test_a_call_that_ended_in_time_is_not_cancelled_when_its_deadline_passes() -> None:
    async def main() -> None:
        deadlines = Deadlines()
        with deadlines.within(0.05):
            await asyncio.sleep(0)
        # The timer armed for that deadline fires while this task waits: it must not
        # cancel a task whose call is over.
        with pytest.raises(TimeoutError):  # another task's deadline, not this one's
            await asyncio.create_task(_hang(deadlines, 0.1))

    asyncio.run(main())


def test_a_cancel_from_outside_stays_a_cancel() -> None:
    async def main() -> None:
        deadlines = Deadlines()
        task = asyncio.create_task(_hang(deadlines, NEVER))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_cancel_from_outside_at_the_deadline_stays_a_cancel() -> None:
    """As asyncio.timeout: when the task was also cancelled by someone else, the
    deadline's cancel is taken back and the other one goes on."""

    async def main() -> None:
        deadlines = Deadlines()
        started = asyncio.Event()

        async def hang_then_be_cancelled() -> None:
            with deadlines.within(0.05):
                started.set()
                try:
                    await asyncio.Event().wait()
                finally:
                    current = asyncio.current_task()
                    assert current is not None
                    current.cancel()  # a second cancel arrives as the deadline's lands

        task = asyncio.create_task(hang_then_be_cancelled())
        await started.wait()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_the_deadlines_hold_on_each_loop_that_runs_them() -> None:
    deadlines = Deadlines()

    async def one() -> None:
        with deadlines.within(NEVER):  # a timer on this loop, never fired
            await asyncio.sleep(0)
        with pytest.raises(TimeoutError):
            await _hang(deadlines, 0.05)

    asyncio.run(one())
    asyncio.run(one())  # the first loop's timer is gone with it


def test_calls_that_end_in_time_share_one_timer() -> None:
    """A timer armed and cancelled per call was most of a budget's cost on every
    forwarded call: the calls of one forwarder arm one, for the earliest deadline."""

    async def main() -> None:
        deadlines = Deadlines()
        for _ in range(50):
            with deadlines.within(30.0):
                await asyncio.sleep(0)

    TimerCountingLoop.timers = 0
    with asyncio.Runner(loop_factory=TimerCountingLoop) as runner:
        runner.run(main())
    assert TimerCountingLoop.timers == 1
