"""Every size the guard accepts, in one place, and the memory limit they add up to.

Past a cap, what the step or a server sends is dropped, never held whole, so the
guard's memory is bounded by these numbers (see guard.spec.md, Limits).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final, NamedTuple

from sandbox.contracts import guardprocess as _process

if TYPE_CHECKING:
    from starlette.types import Receive

MiB: Final = _process.MiB

# From the step, on the bridge and MCP port.
MAX_REQUEST_BYTES: Final = _process.MAX_REQUEST_BYTES  # one request body (4 MiB)
MAX_HEADER_BYTES: Final = 16 * 1024  # one request's header lines, together
# The HTTP server's own fence for a request head it cannot parse within
# (a bare 400, no line: the head never reached the guard's code).
TRANSPORT_MAX_HEAD_BYTES: Final = 64 * 1024

# Replies the guard reads before it answers the step.
MAX_MCP_MESSAGE_BYTES: Final = _process.MAX_MCP_MESSAGE_BYTES  # one JSON-RPC message (8 MiB)
MAX_MCP_LISTING_BYTES: Final = 8 * MiB  # one tools/list answer, every page together
MAX_UPSTREAM_REPLY_BYTES: Final = _process.MAX_UPSTREAM_REPLY_BYTES  # the bridge's reply (8 MiB)
MAX_EXEC_REPLY_BYTES: Final = _process.MAX_EXEC_REPLY_BYTES  # the executor's reply (8 MiB)

# Forwarded calls (MCP, bridge upstream, executor) whose reply the guard may
# hold at once.
FORWARD_SLOTS: Final = _process.FORWARD_SLOTS


class ForwardSlots(asyncio.Semaphore):
    """The guard's FORWARD_SLOTS: asyncio's Semaphore, entered without its `acquire`
    coroutine and `locked()`'s generator while a slot is free and no one waits (every
    forwarded call, one client or a few). Anything else is `acquire`'s own, so the
    order, the fairness and the cancel rules are the Semaphore's (tests/guard/test_limits.py)."""

    async def __aenter__(self) -> None:
        if self._value > 0 and not self._waiters:
            self._value -= 1
            return
        await self.acquire()


# What these caps let the guard hold, with room to spare: its container's memory limit
# (the runner sets it; the bound's reasoning is beside the figures it adds up).
GUARD_MEMORY_BYTES: Final = _process.GUARD_MEMORY_BYTES


class CappedBody(NamedTuple):
    """A request body read up to a cap: `complete` when it ended within the cap;
    otherwise `body` is what was read (the rest still waits in `receive`), and `gone`
    says the client hung up rather than sent too much."""

    body: bytes
    complete: bool
    gone: bool


async def read_capped_body(receive: Receive, cap: int) -> CappedBody:
    """An ASGI request's body, never more than `cap` bytes (and one chunk) held."""

    async def next_chunk() -> tuple[bytes, bool] | None:
        message = await receive()
        if message["type"] != "http.request":
            return None
        return message.get("body", b""), message.get("more_body", False)

    return await read_capped(next_chunk, cap)


async def read_capped(
    next_chunk: Callable[[], Awaitable[tuple[bytes, bool] | None]], cap: int
) -> CappedBody:
    """A request body from `next_chunk` (a chunk and whether more follows; None: the
    client hung up), never more than `cap` bytes (and one chunk) held. One loop for
    every reader of a capped body: ASGI's `receive` and the guard's own HTTP protocol."""
    chunks: list[bytes] = []
    size = 0
    while True:
        got = await next_chunk()
        if got is None:
            return CappedBody(b"".join(chunks), complete=False, gone=True)
        chunk, more = got
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            return CappedBody(b"".join(chunks), complete=False, gone=False)
        if not more:
            return CappedBody(b"".join(chunks), complete=True, gone=False)


def mib(size: int) -> str:
    """A cap as people read it: `8 MiB`, `16 KiB`."""
    if size % MiB == 0:
        return f"{size // MiB} MiB"
    return f"{size // 1024} KiB"
