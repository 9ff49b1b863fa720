"""The guard's client side: one long-lived session to each configured MCP server.

A stdio server is reached over its socket (`sockets.SocketSession`), a URL server
with the SDK's `Client` over `urlserver.http_transport`; either way a result is
relayed as the raw JSON the server sent, and every failure is one `McpServerError`
whose reason the caller can log. A stdio server has one life; a URL server whose
session is lost is reconnected once, inside the request that notices it."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from typing import Any, NamedTuple

import anyio
import mcp_types as types
from mcp import Client
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel, ConfigDict, ValidationError

from sandbox.contracts.guardparts import McpServer
from sandbox.guard import limits
from sandbox.guard.mcp.sockets import (
    REPLY_TOO_LARGE,
    MalformedReply,
    SocketSession,
    open_socket_session,
)
from sandbox.guard.mcp.urlserver import CAP_MARK, http_transport

CONNECT_DEADLINE_S = 20.0  # one connect attempt (a stdio server's container start + handshake)
MAX_LIST_PAGES = 50
CLIENT_INFO = types.Implementation(name="sandbox-guard", version="1")


class _Raw(BaseModel):
    """A result exactly as the server sent it (every key kept, nothing coerced)."""

    model_config = ConfigDict(extra="allow")


class Wire(NamedTuple):
    """A request the guard builds itself, as its JSON-RPC `method` and `params` (from
    values validated already): a stdio server is sent these as they are, and only a
    URL server's SDK client gets the typed request made of them. The lookup and the
    call of every `tools/call` are sent this way, so neither costs a model built,
    validated and dumped again per call."""

    method: str
    params: dict[str, Any]

    def typed(self) -> types.ClientRequest:
        """The SDK's request model of it (for a URL server's client)."""
        return types.client_request_adapter.validate_python(
            {"method": self.method, "params": self.params}
        )


def tools_page(cursor: str | None) -> Wire:
    """One `tools/list` page: the params `ListToolsRequest(...)` dumps to."""
    return Wire("tools/list", {"cursor": cursor} if cursor is not None else {})


def tool_call(name: str, arguments: dict[str, Any] | None) -> Wire:
    """A `tools/call` of only `name` and `arguments` (nothing else the step sent, such
    as `_meta`, goes on): the params `CallToolRequest(...)` dumps to."""
    return Wire(
        "tools/call",
        {"name": name, "arguments": arguments} if arguments is not None else {"name": name},
    )


class McpServerError(Exception):
    """The server could not be asked (not running, timed out, broke the protocol)."""

    def __init__(self, reason: str, *, lost: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.lost = lost


class McpTimeout(McpServerError):
    """The server did not answer one request within its time."""


class McpReplyTooLarge(McpServerError):
    """The server's reply passed its cap and was dropped unread."""


def describe(exc: BaseException) -> str:
    """One line for an exception, unwrapping anyio's exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:300]


def maybe_lost(exc: MCPError, *, stdio: bool) -> bool:
    """Does this error say the connection (or, over HTTP, the session) is gone?"""
    if exc.code == types.CONNECTION_CLOSED:
        return True
    if stdio:
        return False
    # The streamable-HTTP transport's spellings of a 404 on a known session and of a
    # bare HTTP error status (a restarted server that no longer knows the session).
    return (exc.code, exc.message) in {
        (types.INVALID_REQUEST, "Session terminated"),
        (types.INTERNAL_ERROR, "Server returned an error response"),
    }


class Upstream:
    """One long-lived client session to one configured MCP server.

    A stdio server has one life: its socket accepts one connection, and a server
    that goes away stays down for the run."""

    def __init__(
        self, server: McpServer, listener: socket.socket | None, expected_uid: int | None
    ) -> None:
        self.server = server
        self.name = server.name
        self._listener = listener
        self._expected_uid = expected_uid
        self._client: Client | SocketSession | None = None
        self._down_reason: str | None = "not started yet"
        self._attempts = 0  # connect attempts finished (a success or a failure)
        self._attempt_done = anyio.Event()  # replaced and set at each finished attempt
        self._want_connect = False  # a caller asks the supervisor for a new session
        self._wake = anyio.Event()
        self._lost = anyio.Event()

    @property
    def is_stdio(self) -> bool:
        return self.server.command is not None

    # -- the connection's task -------------------------------------------------

    def _client_for(self) -> contextlib.AbstractAsyncContextManager[Client | SocketSession]:
        """A stdio server's `SocketSession`, or a URL server's SDK `Client`."""
        if self.server.command is not None:
            listener, self._listener = self._listener, None
            if listener is None:
                raise McpServerError("the server's socket is not listening")
            return open_socket_session(
                listener,
                expected_uid=self._expected_uid,
                accept_deadline_s=CONNECT_DEADLINE_S,
                client_info=CLIENT_INFO.model_dump(exclude_none=True),
            )
        assert self.server.url is not None
        return Client(
            http_transport(self.server.url),
            mode="auto",
            cache=None,
            client_info=CLIENT_INFO,
            read_timeout_seconds=CONNECT_DEADLINE_S,
        )

    async def supervise(self) -> None:
        """Hold the session open; reconnect URL servers when asked; stdio: one life."""
        while True:
            self._lost = anyio.Event()
            connected = False
            try:
                async with self._client_for() as client:
                    self._client = client
                    self._down_reason = None
                    connected = True
                    self._attempt_finished()
                    await self._lost.wait()
            except Exception as exc:
                if not connected:
                    self._down_reason = f"cannot connect: {describe(exc)}"
            finally:
                self._client = None
            if not connected:
                self._attempt_finished()
            if self.is_stdio:
                return
            while not self._want_connect:
                self._wake = anyio.Event()
                await self._wake.wait()
            self._want_connect = False

    def _attempt_finished(self) -> None:
        self._attempts += 1
        self._attempt_done.set()
        self._attempt_done = anyio.Event()

    async def _wait_attempt(self, after: int) -> None:
        while self._attempts <= after:
            await self._attempt_done.wait()

    async def wait_first_attempt(self) -> None:
        await self._wait_attempt(0)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _mark_lost(self, reason: str) -> None:
        """Stop using the current session at once; the supervisor closes it."""
        if self._client is not None:
            self._client = None
            self._down_reason = reason
            self._lost.set()

    # -- requests ----------------------------------------------------------------

    async def _connected(self) -> Client | SocketSession:
        """The live session; a URL server without one is asked for a new one first."""
        if self._client is None and self._attempts == 0:  # the first attempt is running
            await self._wait_attempt(0)
        elif self._client is None and not self.is_stdio:
            seen = self._attempts
            self._want_connect = True
            self._wake.set()
            await self._wait_attempt(seen)
        client = self._client
        if client is None:
            down = self._down_reason or "not connected"
            if self.is_stdio:
                down = f"the server is not running ({down})"
            raise McpServerError(down)
        return client

    async def request(
        self,
        request: Wire | types.ClientRequest | types.Request[Any, Any],
        timeout_s: float,
        *,
        retry: bool = True,
    ) -> dict[str, Any]:
        """Send one request; the raw result dict.

        A URL server's session that looks lost (connection closed, session
        unknown, a bare HTTP error) is dropped; a request that is safe to repeat
        (`retry`: listings and reads, never `tools/call`) is then sent once more
        on a new session."""
        for attempt in (0, 1):
            client = await self._connected()
            try:
                if isinstance(client, SocketSession):
                    params: dict[str, Any] | None
                    if isinstance(request, Wire):
                        method, params = request
                    else:
                        wire = request.model_dump(by_alias=True, mode="json", exclude_none=True)
                        method, params = wire["method"], wire.get("params")
                    result = await client.request(method, params, timeout_s)
                else:
                    typed = request.typed() if isinstance(request, Wire) else request
                    raw = await client.session.send_request(
                        typed, _Raw, request_read_timeout_seconds=timeout_s
                    )
                    result = dict(raw.model_extra or {})
                # A handshake-era server's result, relayed to a 2026-07-28 client, says so.
                result.setdefault("resultType", "complete")
                return result
            except MCPError as exc:
                if exc.code == types.REQUEST_TIMEOUT:
                    raise McpTimeout(f"no answer within {timeout_s:g} s") from None
                if exc.code == REPLY_TOO_LARGE or CAP_MARK in exc.message:
                    raise McpReplyTooLarge(exc.message) from None
                if not maybe_lost(exc, stdio=self.is_stdio):
                    raise
                self._mark_lost(f"the server closed the connection ({exc.message})")
                if attempt == 0 and retry and not self.is_stdio:
                    continue
                raise McpServerError(self._down_reason or exc.message, lost=True) from None
            except MalformedReply as exc:
                raise McpServerError(f"malformed reply: {exc}") from None
            except ValidationError as exc:
                raise McpServerError(
                    f"malformed reply: {describe(exc).splitlines()[0][:200]}"
                ) from None
            except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
                self._mark_lost(f"the connection broke ({type(exc).__name__})")
                if attempt == 0 and retry and not self.is_stdio:
                    continue
                raise McpServerError(self._down_reason or "connection broke", lost=True) from None
        raise McpServerError("unreachable")  # pragma: no cover

    async def list_tools(self, deadline_s: float) -> list[dict[str, Any]]:
        """Every tool the server lists right now, as the raw JSON objects it sent."""
        tools: list[dict[str, Any]] = []
        cursor: str | None = None
        begin = time.monotonic()
        listed_bytes = 0
        # A live stdio session times each page itself; the overall deadline covers
        # the rest (waiting for a connection, a URL server's reconnect).
        overall = (
            contextlib.nullcontext()
            if isinstance(self._client, SocketSession)
            else anyio.fail_after(deadline_s)
        )
        with overall:
            for page_number in range(MAX_LIST_PAGES):
                if page_number and time.monotonic() - begin >= deadline_s:
                    raise TimeoutError
                try:
                    page = await self.request(
                        tools_page(cursor), max(0.05, deadline_s - (time.monotonic() - begin))
                    )
                except McpTimeout:
                    raise TimeoutError from None  # the lookup's budget, not the page's rest
                listed = page.get("tools")
                if not isinstance(listed, list):
                    raise McpServerError("tools/list reply has no tools array")
                cursor = page.get("nextCursor")
                more = isinstance(cursor, str) and bool(cursor)
                if more or page_number:  # one page is capped by its message; many add up
                    listed_bytes += len(json.dumps(listed))
                    if listed_bytes > limits.MAX_MCP_LISTING_BYTES:
                        cap = limits.mib(limits.MAX_MCP_LISTING_BYTES)
                        raise McpReplyTooLarge(f"tools/list pages together are {CAP_MARK} of {cap}")
                tools.extend(t for t in listed if isinstance(t, dict))
                if not more:
                    return tools
        raise McpServerError(f"tools/list has more than {MAX_LIST_PAGES} pages")
