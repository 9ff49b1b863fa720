"""The guard's end of one stdio MCP server: a unix socket, and every byte on it hostile.

A relay in the server's container (`sandbox/stepside/agentworks_relay.py`) hands
its connection to the socket to the server as stdin and stdout. `SocketSession` is
JSON-RPC checked by envelope, not the SDK's typed session: results are relayed as
raw JSON. One connection from the server's own uid; lines read capped; only
answers to the guard's own requests reach a caller; every request has a time
budget (mcp.spec.md lists the rules)."""

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
import pydantic_core
from mcp.shared.exceptions import MCPError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION

from sandbox.guard.limits import MAX_MCP_MESSAGE_BYTES, mib

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


def _coerce(request_id: Any) -> Any:
    """ "7" and 7 are one id for correlation (as the SDK treats them)."""
    if isinstance(request_id, str):
        with contextlib.suppress(ValueError):
            return int(request_id)
    return request_id


# --------------------------------------------------------------------------- SocketSession


class MalformedReply(Exception):
    """The server answered a request with something that is not a result object."""


class SocketSession:
    """A JSON-RPC client session on the server's one connection (see the module's rules).

    `request` sends one request and waits, within its budget, for the answer to its
    own id: the raw result object, or `MCPError` (the server's error; or
    REPLY_TOO_LARGE, REQUEST_TIMEOUT, CONNECTION_CLOSED from here). Start it with
    `open_socket_session`, which also runs the initialize handshake."""

    def __init__(self, conn: socket.socket, cap: int) -> None:
        self._conn = conn
        self._cap = cap
        self._loop = asyncio.get_running_loop()
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._send_lock = asyncio.Lock()
        self._closed: str | None = None  # why the connection is gone (None: open)
        self.protocol_version = ""
        self.server_info: dict[str, Any] = {}

    # -- sending -------------------------------------------------------------------

    async def _send(self, message: dict[str, Any]) -> None:
        data = pydantic_core.to_json(message) + b"\n"
        async with self._send_lock:
            await self._loop.sock_sendall(self._conn, data)

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        with contextlib.suppress(OSError):
            await self._send(message)

    async def request(
        self, method: str, params: dict[str, Any] | None, timeout_s: float
    ) -> dict[str, Any]:
        if self._closed is not None:
            raise MCPError(code=types.CONNECTION_CLOSED, message=self._closed)
        if len(self._pending) >= MAX_PENDING:
            raise MCPError(code=types.INTERNAL_ERROR, message="too many requests in flight")
        self._next_id += 1
        request_id = self._next_id
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        try:
            data = pydantic_core.to_json(message) + b"\n"
            pydantic_core.from_json(data)  # the depth the server's side of the SDK takes
        except ValueError as exc:
            raise MCPError(
                code=types.INVALID_PARAMS, message=f"the request cannot be sent: {exc}"
            ) from None
        answer: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._pending[request_id] = answer
        # A timer on the future, not a cancel scope: the same budget at a fraction
        # of the cost per request (covers the send as well as the wait).
        timer = self._loop.call_later(timeout_s, _expire, answer)
        try:
            async with self._send_lock:
                await self._loop.sock_sendall(self._conn, data)
            return await answer
        except TimeoutError:
            await self.notify(
                "notifications/cancelled", {"requestId": request_id, "reason": "timed out"}
            )
            raise MCPError(
                code=types.REQUEST_TIMEOUT, message=f"no answer within {timeout_s:g} s"
            ) from None
        except OSError as exc:
            self._close(f"Connection closed ({type(exc).__name__})")
            raise MCPError(code=types.CONNECTION_CLOSED, message="Connection closed") from None
        finally:
            timer.cancel()
            self._pending.pop(request_id, None)

    # -- reading -------------------------------------------------------------------

    async def read_loop(self) -> None:
        lines = LineReader(self._cap)
        try:
            while data := await self._loop.sock_recv(self._conn, CHUNK):
                for item in lines.feed(data):
                    if isinstance(item, Oversized):
                        self._dropped(item)
                    else:
                        await self._deliver(item)
        except OSError:
            pass
        self._close("Connection closed")

    def _close(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(MCPError(code=types.CONNECTION_CLOSED, message=reason))

    def _waiting(self, request_id: Any) -> asyncio.Future[dict[str, Any]] | None:
        key = _coerce(request_id)
        answer = self._pending.get(key) if isinstance(key, int) else None
        return answer if answer is not None and not answer.done() else None

    async def _deliver(self, line: bytes) -> None:
        try:
            message = pydantic_core.from_json(line)
        except ValueError:
            return  # not JSON the SDK would take (nested too deep, broken): dropped
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            return
        request_id = message.get("id")
        if "method" in message:
            if request_id is None or isinstance(request_id, bool | float | dict | list):
                return  # a notification (or nothing answerable): dropped
            # The guard advertises no client capability; only a ping is answered.
            with contextlib.suppress(OSError):
                if message.get("method") == "ping":
                    await self._send({"jsonrpc": "2.0", "id": request_id, "result": {}})
                else:
                    refusal = {
                        "code": types.METHOD_NOT_FOUND,
                        "message": f"{message.get('method')} is not served by the test-mode guard",
                    }
                    await self._send({"jsonrpc": "2.0", "id": request_id, "error": refusal})
            return
        answer = self._waiting(request_id)
        if answer is None:
            return  # an answer to nothing the guard is waiting for
        if "error" in message:
            error = message.get("error")
            if not isinstance(error, dict):
                return
            try:
                data = types.ErrorData.model_validate(error)
            except ValueError:
                return
            answer.set_exception(MCPError(code=data.code, message=data.message, data=data.data))
        elif isinstance(message.get("result"), dict):
            answer.set_result(message["result"])
        else:
            answer.set_exception(MalformedReply("the result is not an object"))

    def _dropped(self, big: Oversized) -> None:
        target = next((a for i in big.candidate_ids() if (a := self._waiting(i))), None)
        if target is None:
            waiting = [a for a in self._pending.values() if not a.done()]
            target = waiting[0] if len(waiting) == 1 else None
        if target is not None:
            error = too_large_error(big.size, self._cap)
            target.set_exception(MCPError.from_error_data(error))


def _expire(answer: asyncio.Future[dict[str, Any]]) -> None:
    if not answer.done():
        answer.set_exception(TimeoutError())


@contextlib.asynccontextmanager
async def open_socket_session(
    listener: socket.socket,
    *,
    expected_uid: int | None,
    accept_deadline_s: float,
    client_info: dict[str, Any],
    cap: int = MAX_MCP_MESSAGE_BYTES,
) -> AsyncIterator[SocketSession]:
    """The server's connection, its reader running and the handshake done (within
    `accept_deadline_s` for both); closed on exit."""
    conn = await accept_one(listener, expected_uid=expected_uid, deadline_s=accept_deadline_s)
    try:
        session = SocketSession(conn, cap)
        async with anyio.create_task_group() as tg:
            tg.start_soon(session.read_loop)
            params = {
                "protocolVersion": LATEST_HANDSHAKE_VERSION,
                "capabilities": {},
                "clientInfo": client_info,
            }
            result = await session.request("initialize", params, accept_deadline_s)
            version = result.get("protocolVersion")
            if version not in HANDSHAKE_PROTOCOL_VERSIONS:
                raise ConnectionError(f"the server answered protocol version {version!r}")
            session.protocol_version = str(version)
            info = result.get("serverInfo")
            session.server_info = info if isinstance(info, dict) else {}
            await session.notify("notifications/initialized")
            try:
                yield session
            finally:
                tg.cancel_scope.cancel()
    finally:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()
