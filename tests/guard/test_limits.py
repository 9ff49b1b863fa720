"""The guard's forward slots: asyncio's Semaphore, its order and cancel rules kept."""

from __future__ import annotations

import asyncio

import pytest

from sandbox.guard.limits import ForwardSlots


async def _script(slots: asyncio.Semaphore) -> list[str]:
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
        for _ in range(5):
            await asyncio.sleep(0)
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
    held.append(f"free {slots._value}")
    return held


def test_forward_slots_are_held_in_the_semaphore_s_order() -> None:
    expected = asyncio.run(_script(asyncio.Semaphore(2)))
    assert expected == ["a", "b", "d", "e", "f", "g", "h", "free 2"]
    assert asyncio.run(_script(ForwardSlots(2))) == expected


def test_a_free_slot_is_taken_without_the_semaphore_s_acquire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The point of the class: entered straight while a slot is free and no one waits."""
    acquired: list[int] = []
    original = asyncio.Semaphore.acquire

    async def counted(self: asyncio.Semaphore) -> bool:
        acquired.append(1)
        return await original(self)

    monkeypatch.setattr(asyncio.Semaphore, "acquire", counted)

    async def twice() -> int:
        slots = ForwardSlots(1)
        async with slots:
            pass
        async with slots:
            pass
        return slots._value

    assert asyncio.run(twice()) == 1
    assert acquired == []


def test_a_slot_is_given_back_without_the_semaphore_s_release_while_no_one_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Left straight while no one waits; with a waiter, `release` wakes it."""
    released: list[int] = []
    original = asyncio.Semaphore.release

    def counted(self: asyncio.Semaphore) -> None:
        released.append(1)
        original(self)

    monkeypatch.setattr(asyncio.Semaphore, "release", counted)

    async def main() -> tuple[int, int]:
        slots = ForwardSlots(1)
        async with slots:
            pass
        alone = len(released)
        entered = asyncio.Event()

        async def waiter() -> None:
            async with slots:
                entered.set()

        async with slots:
            task = asyncio.create_task(waiter())
            await asyncio.sleep(0)  # it waits for the slot held here
        await task
        assert entered.is_set()
        return alone, slots._value

    assert asyncio.run(main()) == (0, 1)
    assert released == [1]  # the exit that had a waiter to wake
