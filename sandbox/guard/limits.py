"""Every size the guard accepts, in one place, and the memory limit they add up to.

Past a cap, what the step or a server sends is dropped, never held whole, so the
guard's memory is bounded by these numbers (see guard.spec.md, Limits).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final, NamedTuple

from sandbox.contracts.guardprocess import MAX_REQUEST_BYTES as _WIRE_MAX_REQUEST_BYTES

if TYPE_CHECKING:
    from starlette.types import Receive

MiB: Final = 1024 * 1024

# From the step, on the bridge and MCP port.
MAX_REQUEST_BYTES: Final = _WIRE_MAX_REQUEST_BYTES  # one request body (4 MiB)
MAX_HEADER_BYTES: Final = 16 * 1024  # one request's header lines, together
# The HTTP server's own fence for a request head it cannot parse within
# (a bare 400, no line: the head never reached the guard's code).
TRANSPORT_MAX_HEAD_BYTES: Final = 64 * 1024

# Replies the guard reads before it answers the step.
MAX_MCP_MESSAGE_BYTES: Final = 8 * MiB  # one JSON-RPC message from an MCP server
MAX_MCP_LISTING_BYTES: Final = 8 * MiB  # one tools/list answer, every page together
MAX_UPSTREAM_REPLY_BYTES: Final = 8 * MiB  # the real bridge's reply body
MAX_EXEC_REPLY_BYTES: Final = 8 * MiB  # the step executor's reply body

# Forwarded calls (MCP, bridge upstream, executor) whose reply the guard may
# hold at once.
FORWARD_SLOTS: Final = 4


class ForwardSlots(asyncio.Semaphore):
    """The guard's FORWARD_SLOTS: asyncio's Semaphore, entered without its `acquire`
    coroutine and `locked()`'s generator while a slot is free and no one waits (every
    forwarded call, one client or a few), and left without `release` while no one
    waits. Anything else is `acquire`'s and `release`'s own, so the order, the
    fairness and the cancel rules are the Semaphore's (tests/guard/test_limits.py)."""

    async def __aenter__(self) -> None:
        if self._value > 0 and not self._waiters:
            self._value -= 1
            return
        await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._waiters:  # no one to wake: `release` would only count the slot back
            self._value += 1
            return
        self.release()


# A reply in memory exists several times over while it is parsed and relayed
# (bytes read, parsed objects, the reply serialized for the step, its body):
# measured at about 5x its size for an MCP result (the guard container's
# cgroup peak: 60 MiB idle, 97 MiB with one 7 MB result, 139 MiB with sixteen
# at once); 8x leaves room.
_COPIES: Final = 8
_GUARD_BASE_BYTES: Final = 160 * MiB  # the guard's own RSS (~50-70 MB) with headroom
_LARGEST_REPLY: Final = max(MAX_MCP_MESSAGE_BYTES, MAX_UPSTREAM_REPLY_BYTES, MAX_EXEC_REPLY_BYTES)
GUARD_MEMORY_BYTES: Final = _GUARD_BASE_BYTES + FORWARD_SLOTS * _COPIES * _LARGEST_REPLY


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
