"""The step's end of a connection: a read's deadline and a reply's write."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from sandbox.guard.egress.connection import Client, read_within


def _on_uvloop(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(test())


async def _pair() -> tuple[socket.socket, asyncio.StreamReader, asyncio.StreamWriter]:
    step, guard = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=guard)
    return step, reader, writer


def test_a_read_past_its_deadline_is_a_timeout_and_leaves_no_cancel_behind() -> None:
    """A client that sends nothing: the read ends in TimeoutError (the proxy's idle or
    408 path), the task has no cancel pending, and the next read still gets the bytes."""

    async def test() -> None:
        step, reader, writer = await _pair()
        task = asyncio.current_task()
        assert task is not None
        with pytest.raises(TimeoutError):
            await read_within(reader, 1024, 0.05)
        assert task.cancelling() == 0
        step.send(b"GET")
        assert await read_within(reader, 1024, 30) == b"GET"
        writer.close()
        step.close()

    _on_uvloop(test)


def test_a_read_cancelled_from_outside_is_a_cancel_not_a_timeout() -> None:
    """The guard stopping cancels a connection's read: that is passed on as a cancel,
    never reported as the client's timeout."""

    async def test() -> None:
        step, reader, writer = await _pair()
        reading = asyncio.ensure_future(read_within(reader, 1024, 30))
        for _ in range(20):
            await asyncio.sleep(0)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        writer.close()
        step.close()

    _on_uvloop(test)


def test_a_reply_written_to_a_lost_connection_raises() -> None:
    """A write that finds the step's connection gone raises ConnectionError, so the
    request's outcome line says the reply did not reach the step (a write is not
    awaited only when all of it reached the kernel of a connection still open)."""

    async def test() -> None:
        step, reader, writer = await _pair()
        client = Client(reader, writer, 1)
        await client.write(b"first")
        assert step.recv(16) == b"first"
        step.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        step.close()  # a reset
        with pytest.raises(ConnectionError):
            for _ in range(50):
                await client.write(b"x" * 65536)
                await asyncio.sleep(0)
        writer.close()

    _on_uvloop(test)
