"""The guard's end of one stdio MCP server: a unix socket, and every byte on it hostile.

Each stdio server runs in its own container; a small relay there
(`sandbox/stepside/agentworks_relay.py`) connects to the socket the guard listens on in that
server's folder and pipes the server's stdin and stdout through it. This
module is the MCP SDK client transport over that socket:

- one connection per server: the first accepted connection, from the
  server's own uid (SO_PEERCRED), and the listener is closed after it;
- a capped line reader: a message longer than `MAX_MCP_MESSAGE_BYTES` is never
  held; it is read through and dropped, and the request it answered (found by
  its id, or the one request in flight) gets a JSON-RPC error
  `REPLY_TOO_LARGE` that names its size and the cap;
- the guard speaks first and asks; the server only answers: a response is
  delivered only to a request the guard sent and is still waiting for; a
  server's own requests are answered here (`ping`) or refused, and its
  notifications are dropped, so nothing it sends unasked reaches the SDK or
  costs the guard more than the read.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import mcp_types as types
from mcp.client._transport import TransportStreams
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from sandbox.guard.caps import MAX_MCP_MESSAGE_BYTES, mib

# A guard-defined error code (the implementation-defined band of MCP error codes).
REPLY_TOO_LARGE = -32010
CHUNK = 256 * 1024
MAX_PENDING = 1000  # request ids remembered at once (the guard sends a few at a time)
_KEEP = 4096  # bytes kept of each end of an oversized message, to find its id
_ID = re.compile(rb'"id"\s*:\s*(-?\d{1,18}|"(?:[^"\\]|\\.){0,200}")')


@dataclass(frozen=True)
class Oversized:
    """A message that passed the cap: its size and its two ends (the rest was dropped)."""

    size: int
    head: bytes
    tail: bytes

    def candidate_ids(self) -> list[types.RequestId]:
        """Top-level-looking ids, tail first (node servers write `id` last), then head."""
        found: list[types.RequestId] = []
        for part in (self.tail, self.head):
            matches = _ID.findall(part)
            for raw in reversed(matches) if part is self.tail else matches:
                text = raw.decode("utf-8", "replace")
                found.append(int(text) if not text.startswith('"') else text[1:-1])
        return found


class LineReader:
    """Newline-delimited messages from a byte stream, none held past `cap` bytes."""

    def __init__(self, cap: int = MAX_MCP_MESSAGE_BYTES) -> None:
        self.cap = cap
        self._partial = bytearray()
        self._dropping = 0  # bytes of an oversized message read so far (0: none)
        self._head = b""
        self._tail = bytearray()

    def feed(self, data: bytes) -> list[bytes | Oversized]:
        out: list[bytes | Oversized] = []
        start = 0
        while start < len(data):
            end = data.find(b"\n", start)
            piece = data[start:] if end < 0 else data[start:end]
            start = len(data) if end < 0 else end + 1
            if self._dropping:
                self._drop(piece)
            elif len(self._partial) + len(piece) > self.cap:
                whole = bytes(self._partial) + piece
                self._partial.clear()
                self._dropping = 0
                self._head = whole[:_KEEP]
                self._tail.clear()
                self._drop(whole)
            else:
                self._partial += piece
            if end < 0:
                break
            if self._dropping:
                out.append(Oversized(self._dropping, self._head, bytes(self._tail)))
                self._dropping = 0
            else:
                if self._partial.strip():
                    out.append(bytes(self._partial))
                self._partial.clear()
        return out

    def _drop(self, piece: bytes) -> None:
        self._dropping += len(piece)
        self._tail += piece[-_KEEP:]
        del self._tail[:-_KEEP]


def too_large_error(size: int, cap: int) -> types.ErrorData:
    return types.ErrorData(
        code=REPLY_TOO_LARGE,
        message=(
            f"the MCP server's reply was {size} bytes, larger than the guard's cap of "
            f"{mib(cap)}; it was dropped"
        ),
        data={"reply_bytes": size, "cap_bytes": cap},
    )


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


async def accept_one(
    listener: socket.socket, *, expected_uid: int | None, deadline_s: float
) -> socket.socket:
    """The server's one connection; the listener is closed once it is taken."""
    loop = asyncio.get_running_loop()
    listener.setblocking(False)
    try:
        with anyio.fail_after(deadline_s):
            conn, _ = await loop.sock_accept(listener)
    except TimeoutError:
        raise ConnectionError(f"the server did not connect within {deadline_s:g} s") from None
    finally:
        listener.close()
    if expected_uid is not None:
        uid = peer_uid(conn)
        if uid != expected_uid:
            conn.close()
            raise ConnectionError(f"a process of uid {uid}, not the server's, connected")
    conn.setblocking(False)
    return conn


@contextlib.asynccontextmanager
async def socket_transport(
    listener: socket.socket,
    *,
    expected_uid: int | None,
    accept_deadline_s: float,
    cap: int = MAX_MCP_MESSAGE_BYTES,
) -> AsyncIterator[TransportStreams]:
    """An MCP client transport over the server's socket (see the module's rules)."""
    conn = await accept_one(listener, expected_uid=expected_uid, deadline_s=accept_deadline_s)
    loop = asyncio.get_running_loop()
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    pending: list[types.RequestId] = []  # requests sent, not yet answered, oldest first
    send_lock = anyio.Lock()

    async def send(message: types.JSONRPCMessage) -> None:
        data = message.model_dump_json(by_alias=True, exclude_unset=True).encode() + b"\n"
        async with send_lock:
            await loop.sock_sendall(conn, data)

    def answered(request_id: Any) -> types.RequestId | None:
        key = _coerce(request_id)
        for waiting in pending:
            if _coerce(waiting) == key:
                pending.remove(waiting)
                return waiting
        return None

    async def deliver(line: bytes) -> None:
        try:
            message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        except (ValidationError, ValueError):
            return  # not a JSON-RPC message: nothing the guard asked for
        if isinstance(message, types.JSONRPCRequest):
            # The guard advertises no client capability; only a ping is answered.
            if message.method == "ping":
                await send(types.JSONRPCResponse(jsonrpc="2.0", id=message.id, result={}))
            else:
                error = types.ErrorData(
                    code=types.METHOD_NOT_FOUND,
                    message=f"{message.method} is not served by the test-mode guard",
                )
                await send(types.JSONRPCError(jsonrpc="2.0", id=message.id, error=error))
            return
        if isinstance(message, types.JSONRPCNotification):
            return
        if message.id is None or answered(message.id) is None:
            return  # an answer to nothing the guard is waiting for
        await read_writer.send(SessionMessage(message))

    async def dropped(big: Oversized) -> None:
        waiting = [i for i in big.candidate_ids() if any(_coerce(i) == _coerce(p) for p in pending)]
        target = answered(waiting[0]) if waiting else None
        if target is None and len(pending) == 1:
            target = pending.pop()
        if target is None:
            return
        error = types.JSONRPCError(jsonrpc="2.0", id=target, error=too_large_error(big.size, cap))
        await read_writer.send(SessionMessage(error))

    async def reader() -> None:
        lines = LineReader(cap)
        try:
            async with read_writer:
                while data := await loop.sock_recv(conn, CHUNK):
                    for item in lines.feed(data):
                        if isinstance(item, Oversized):
                            await dropped(item)
                        else:
                            await deliver(item)
        except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    async def writer() -> None:
        try:
            async with write_reader:
                async for session_message in write_reader:
                    message = session_message.message
                    if isinstance(message, types.JSONRPCRequest):
                        pending.append(message.id)
                        del pending[:-MAX_PENDING]
                    elif (
                        isinstance(message, types.JSONRPCNotification)
                        and message.method == "notifications/cancelled"
                        and message.params
                    ):
                        answered(message.params.get("requestId"))  # given up on
                    await send(message)
        except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            await read_writer.aclose()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            tg.start_soon(writer)
            try:
                yield read_stream, write_stream
            finally:
                tg.cancel_scope.cancel()
    finally:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()
        for stream in (read_stream, write_stream, read_writer, write_reader):
            await stream.aclose()


def _coerce(request_id: Any) -> Any:
    """ "7" and 7 are one id for correlation (as the SDK treats them)."""
    if isinstance(request_id, str):
        with contextlib.suppress(ValueError):
            return int(request_id)
    return request_id
