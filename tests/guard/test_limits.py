"""The guard's forward slots: a counter of the guard's own with asyncio's Semaphore's
order and cancel rules, FIFO waiters, its bound kept and no slot lost or leaked."""

from __future__ import annotations

import asyncio
import random
from types import TracebackType
from typing import Protocol

from sandbox.guard.limits import ForwardSlots

DEADLINE_S = 30.0


class Slots(Protocol):
    def locked(self) -> bool: ...
    async def acquire(self) -> bool: ...
    def release(self) -> None: ...
    async def __aenter__(self) -> None: ...
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


async def _free(slots: Slots) -> int:
    """How many slots are free now (taken and given back: nobody waits when called)."""
    taken = 0
    while not slots.locked():
        await slots.acquire()
        taken += 1
    for _ in range(taken):
        slots.release()
    return taken


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _script(slots: Slots) -> list[str]:
    """Two slots, five calls, one waiter cancelled, a newcomer while others wait: which
    call held a slot, in order."""
    held: list[str] = []
    release = {name: asyncio.Event() for name in "abcdefg"}

    async def call(name: str) -> None:
        async with slots:
            held.append(name)
            await release[name].wait()

    tasks = {}
    for name in "abcd":
        tasks[name] = asyncio.create_task(call(name))
        await asyncio.sleep(0)
    tasks["c"].cancel()  # waiting: it never holds a slot, and takes none from d
    await asyncio.sleep(0)
    release["a"].set()
    await asyncio.sleep(0)
    # a's slot is d's now (woken, not yet run): a newcomer waits behind d, not before it
    tasks["e"] = asyncio.create_task(call("e"))
    await asyncio.sleep(0)
    for name in "bde":
        release[name].set()
        await _turns()
    tasks["f"] = asyncio.create_task(call("f"))  # nothing held: straight in
    release["f"].set()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    # A slot given back while a call waits is that call's: one entering at that very
    # moment (no step of the loop between) waits behind it.
    await slots.acquire()
    await slots.acquire()
    tasks["g"] = asyncio.create_task(call("g"))
    await asyncio.sleep(0)
    release["g"].set()
    slots.release()
    await slots.__aenter__()
    held.append("h")
    slots.release()
    slots.release()
    await tasks["g"]
    held.append(f"free {await _free(slots)}")
    return held


def test_forward_slots_are_held_in_the_semaphore_s_order() -> None:
    expected = asyncio.run(_script(asyncio.Semaphore(2)))
    assert expected == ["a", "b", "d", "e", "f", "g", "h", "free 2"]
    assert asyncio.run(_script(ForwardSlots(2))) == expected


def test_waiters_get_their_slot_in_the_order_they_came() -> None:
    async def run() -> list[int]:
        slots = ForwardSlots(1)
        order: list[int] = []
        await slots.acquire()

        async def call(n: int) -> None:
            async with slots:
                order.append(n)
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(call(n)) for n in range(30)]
        await _turns()
        slots.release()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == list(range(30))


def test_a_free_slot_is_taken_without_a_step_of_the_loop() -> None:
    async def run() -> tuple[bool, bool, bool]:
        slots = ForwardSlots(1)
        stepped = asyncio.Event()
        asyncio.get_running_loop().call_soon(stepped.set)
        async with slots:
            entered_before_a_step = not stepped.is_set()
            taken = slots.try_acquire()
        again = slots.try_acquire()
        return entered_before_a_step, taken, again

    assert asyncio.run(run()) == (True, False, True)


def test_the_bound_holds_under_many_callers_some_cancelled() -> None:
    async def run() -> tuple[int, int, int]:
        rng = random.Random(7)
        slots = ForwardSlots(3)
        inside = most = 0

        async def call() -> None:
            nonlocal inside, most
            async with slots:
                inside += 1
                most = max(most, inside)
                try:
                    await _turns(rng.randrange(4))
                finally:
                    inside -= 1

        tasks = []
        for _ in range(400):
            tasks.append(asyncio.create_task(call()))
            if rng.random() < 0.5:
                await asyncio.sleep(0)
            if rng.random() < 0.2:  # some waiting, some woken, some inside
                rng.choice(tasks).cancel()
        async with asyncio.timeout(DEADLINE_S):  # a lost slot would wait forever
            await asyncio.gather(*tasks, return_exceptions=True)
        cancelled = sum(task.cancelled() for task in tasks)
        return most, await _free(slots), cancelled

    most, free, cancelled = asyncio.run(run())
    assert most == 3  # every slot used, never one more
    assert free == 3  # none lost, none leaked
    assert cancelled > 0


def test_a_waiter_cancelled_before_its_turn_takes_no_slot() -> None:
    async def run() -> tuple[list[str], int]:
        slots = ForwardSlots(1)
        held: list[str] = []
        await slots.acquire()

        async def call(name: str) -> None:
            async with slots:
                held.append(name)

        waiting = asyncio.create_task(call("cancelled"))
        await _turns()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        slots.release()  # to nobody: the cancelled one waits no more
        await call("next")
        return held, await _free(slots)

    assert asyncio.run(run()) == (["next"], 1)


def test_a_waiter_cancelled_after_it_was_handed_a_slot_passes_it_on() -> None:
    async def run() -> tuple[list[str], bool, int]:
        slots = ForwardSlots(1)
        held: list[str] = []
        await slots.acquire()

        async def call(name: str) -> None:
            async with slots:
                held.append(name)

        woken = asyncio.create_task(call("woken"))
        behind = asyncio.create_task(call("behind"))
        await _turns()
        slots.release()  # handed to `woken`, which has not run since
        woken.cancel()
        async with asyncio.timeout(DEADLINE_S):  # a lost slot would wait forever
            await asyncio.gather(woken, behind, return_exceptions=True)
        return held, woken.cancelled(), await _free(slots)

    assert asyncio.run(run()) == (["behind"], True, 1)
