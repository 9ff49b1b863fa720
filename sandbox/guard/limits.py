"""Every size the guard accepts, in one place, and the memory limit they add up to.

Past a cap, what the step or a server sends is dropped, never held whole, so the
guard's memory is bounded by these numbers (see guard.spec.md, Limits).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final, NamedTuple

from sandbox.contracts import guardprocess as _process

if TYPE_CHECKING:
    from types import TracebackType

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


class ForwardSlots:
    """The guard's FORWARD_SLOTS: a counter of its own (asyncio's Semaphore keeps its
    state in private attributes, which the fast path would have to read). A free slot
    is taken without a coroutine step or a future; otherwise the caller waits, in FIFO
    order, on a future of its own. A slot given back while a call waits is handed to
    that call (a newcomer waits behind it); a waiter cancelled before its turn takes
    none, and one cancelled after it was handed a slot passes it on, so no slot is lost
    or held twice (tests/guard/test_limits.py). Usable as `async with`."""

    __slots__ = ("_free", "_waiters")

    def __init__(self, slots: int) -> None:
        # Free slots; while any call waits there is none (a slot given back goes to
        # the first waiter), so a free slot never jumps the queue.
        self._free = slots
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def locked(self) -> bool:
        """No slot is free (a caller would wait)."""
        return not self._free

    def try_acquire(self) -> bool:
        """A free slot, taken now (False: none is free; nothing was taken)."""
        if self._free:
            self._free -= 1
            return True
        return False

    async def acquire(self) -> bool:
        """A slot: free, or the first one given back after every earlier waiter's."""
        if self._free:
            self._free -= 1
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot, then cancelled: the next one's
            else:
                with contextlib.suppress(ValueError):  # release may have skipped it
                    self._waiters.remove(waiter)
            raise
        return True

    def release(self) -> None:
        """A slot given back: to the first caller still waiting, else free."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():  # a cancelled one is skipped (it takes no slot)
                waiter.set_result(None)
                return
        self._free += 1

    async def __aenter__(self) -> None:
        if self._free:
            self._free -= 1
            return
        await self.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


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
