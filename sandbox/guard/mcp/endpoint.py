"""The MCP proxy: every MCP server of the workflow, reachable from the step only here.

Endpoint shape: one streamable-HTTP MCP endpoint per configured server, at
`$AGENTWORKS_MCP_URL/<server name>` (`http://127.0.0.1:8790/mcp/<name>`), with
the run's bridge token as `Authorization: Bearer ...`. `GET $AGENTWORKS_MCP_URL`
lists the server names. Replies are JSON (`json_response`), sessions are the
SDK's (`Mcp-Session-Id`, no idle expiry, at most `MAX_SESSIONS` open per
server: 503 past it, logged), both protocol eras are served (handshake and
2026-07-28). The repeated plain requests of a session (`tools/call`,
`tools/list`, `ping`) are answered by `HotPath` in front of the SDK's transport,
with the same handlers and the same bytes on the wire; everything else goes to
the SDK's transport (see `HotPath`).

Upstream, the guard holds one long-lived MCP client session per server,
started in `running()`. A stdio server runs in
a container of its own, started by the runner beside the guard (never in the
guard's container or as its uid); the guard speaks to it over the unix socket
it listens on in that server's folder, with `sandbox.guard.mcp.sockets`'s
`SocketSession` (raw JSON-RPC checked by envelope, not the SDK's client
session), which treats every byte from it as hostile (one connection, a capped
line reader, answers only to what the guard asked, a time budget per request).
A URL server is reached over streamable HTTP with the official `mcp` SDK's
`Client`, each reply capped the same way. The guard advertises no roots,
sampling or elicitation, and keeps no response cache.

Each `tools/call` from the step:
1. asks the server for its tool list afresh (every page; one `tools/list` round
   trip for a server with one page), within the server's `lookup_budget_s` (5 s unless configured);
2. decides with `policy.decide_mcp` from the annotations exactly as the server
   sent them (raw JSON, so `"readOnlyHint": "true"` is not read as true) and the
   owner's `read_only_overrides`;
3. a stub is one action-log line (`mcp:<server>/<tool>`, category `mcp`, detail
   with the server, the tool, the annotations used and the override), and the
   stub result: a successful `CallToolResult` whose text is the stub reply and,
   when the tool declares an `outputSchema`, `structuredContent` that validates
   against it;
4. an allowed call gets its `start` line before it is sent to the server, and
   its `outcome` line (ok or error, sizes, the server's time) before the result
   goes back unchanged; a result past `MAX_MCP_MESSAGE_BYTES` is dropped unread
   and the step gets a tool error that names the cap.

`tools/list`, `resources/*` reads and `prompts/*` are forwarded (reads; the
reads are logged). Every other request (subscriptions, logging level,
completion, anything new) is refused with METHOD_NOT_FOUND and logged;
notifications from the step are dropped. Nothing raises out of a call: a dead,
hung or broken server is a stub with the reason.

A stdio server that exits stays down for the rest of the run (its calls stub
with the reason); a URL server whose connection or session is lost is
reconnected once, inside the call that notices it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pydantic_core
from mcp import Client
from mcp.client._transport import TransportStreams
from mcp.client.streamable_http import streamable_http_client
from mcp.server import Server
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.streamable_http import CONTENT_TYPE_JSON
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types import methods as _methods
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Message, Receive, Scope, Send

from sandbox import policy
from sandbox.contracts.config import McpServer
from sandbox.guard import caps
from sandbox.guard.actionlog import ActionLog, LogFull
from sandbox.guard.config import MCP_PATH, GuardConfig
from sandbox.guard.gate import BAD_TOKEN, bearer_ok, reject_and_log
from sandbox.guard.listeners import bind_unix
from sandbox.guard.mcp.schema_instance import valid_instance
from sandbox.guard.mcp.sockets import (
    REPLY_TOO_LARGE,
    MalformedReply,
    SocketSession,
    open_socket_session,
)

CONNECT_DEADLINE_S = 20.0  # one connect attempt (a stdio server's container start + handshake)
STARTUP_WAIT_S = 15.0  # how long the guard waits for its servers before serving
MAX_LIST_PAGES = 50
MCP_SOCKET = "mcp.sock"  # in <mcp_dir>/<name>/ (sandbox.contracts.layout.MCP_SOCKET)
CAP_MARK = "larger than the guard's cap"  # in every error that says a reply was too large
CLIENT_INFO = types.Implementation(name="sandbox-guard", version="1")
MAX_SESSIONS = 100  # open step-side sessions per server (the SDK answers 503 past it)

# Requests the proxy serves; everything else from the step is refused (and logged).
FORWARDED_LISTS = ("tools/list", "resources/list", "resources/templates/list", "prompts/list")
LOGGED_READS = ("resources/read", "prompts/get")
SERVED = frozenset({"initialize", "ping", "server/discover", "tools/call"}).union(
    FORWARDED_LISTS, LOGGED_READS
)

_ListRequest = Callable[[types.PaginatedRequestParams], types.Request[Any, Any]]
_LIST_REQUESTS: dict[str, _ListRequest] = {
    "tools/list": lambda p: types.ListToolsRequest(params=p),
    "resources/list": lambda p: types.ListResourcesRequest(params=p),
    "resources/templates/list": lambda p: types.ListResourceTemplatesRequest(params=p),
    "prompts/list": lambda p: types.ListPromptsRequest(params=p),
}


class _Raw(BaseModel):
    """A result exactly as the server sent it (every key kept, nothing coerced)."""

    model_config = ConfigDict(extra="allow")


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


class SlotTimeout(Exception):
    """No forward slot came free within the call's budget."""


def _describe(exc: BaseException) -> str:
    """One line for an exception, unwrapping anyio's exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())[:300]


def _maybe_lost(exc: MCPError, *, stdio: bool) -> bool:
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


class _ReplyCapExceeded(httpx2.StreamError):
    """A URL server's JSON reply passed MAX_MCP_MESSAGE_BYTES."""


class _CappedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, cap: int) -> None:
        self._inner = inner
        self._cap = cap

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._cap:
                raise _ReplyCapExceeded(
                    f"the MCP server's reply was {CAP_MARK} of {caps.mib(self._cap)}; "
                    "it was dropped"
                )
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class _CappedTransport(httpx2.AsyncHTTPTransport):
    """JSON replies read at most MAX_MCP_MESSAGE_BYTES (an event stream is capped per
    event by the SDK's `max_sse_event_size`)."""

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await super().handle_async_request(request)
        if response.headers.get("content-type", "").startswith("application/json"):
            stream = response.stream
            assert isinstance(stream, httpx2.AsyncByteStream)
            response.stream = _CappedStream(stream, caps.MAX_MCP_MESSAGE_BYTES)
        return response


@contextlib.asynccontextmanager
async def _http_transport(url: str) -> AsyncIterator[TransportStreams]:
    """Streamable HTTP with no proxy from the environment, no idle keep-alive, and
    replies capped like a stdio server's.

    A fresh TCP connection per request costs a fraction of a millisecond on the
    networks a guard joins, and a redeployed server (new address, same name) is
    reached at the next request instead of through a dead pooled connection."""
    client = httpx2.AsyncClient(
        timeout=httpx2.Timeout(30.0, read=300.0),
        transport=_CappedTransport(limits=httpx2.Limits(max_keepalive_connections=0)),
        trust_env=False,
    )
    async with (
        client,
        streamable_http_client(
            url, http_client=client, max_sse_event_size=caps.MAX_MCP_MESSAGE_BYTES
        ) as streams,
    ):
        yield streams


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
            _http_transport(self.server.url),
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
                    self._down_reason = f"cannot connect: {_describe(exc)}"
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
        request: types.ClientRequest | types.Request[Any, Any],
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
                    wire = request.model_dump(by_alias=True, mode="json", exclude_none=True)
                    result = await client.request(wire["method"], wire.get("params"), timeout_s)
                else:
                    raw = await client.session.send_request(
                        request, _Raw, request_read_timeout_seconds=timeout_s
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
                if not _maybe_lost(exc, stdio=self.is_stdio):
                    raise
                self._mark_lost(f"the server closed the connection ({exc.message})")
                if attempt == 0 and retry and not self.is_stdio:
                    continue
                raise McpServerError(self._down_reason or exc.message, lost=True) from None
            except MalformedReply as exc:
                raise McpServerError(f"malformed reply: {exc}") from None
            except ValidationError as exc:
                raise McpServerError(
                    f"malformed reply: {_describe(exc).splitlines()[0][:200]}"
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
                        types.ListToolsRequest(params=types.PaginatedRequestParams(cursor=cursor)),
                        max(0.05, deadline_s - (time.monotonic() - begin)),
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
                    if listed_bytes > caps.MAX_MCP_LISTING_BYTES:
                        cap = caps.mib(caps.MAX_MCP_LISTING_BYTES)
                        raise McpReplyTooLarge(f"tools/list pages together are {CAP_MARK} of {cap}")
                tools.extend(t for t in listed if isinstance(t, dict))
                if not more:
                    return tools
        raise McpServerError(f"tools/list has more than {MAX_LIST_PAGES} pages")


# --------------------------------------------------------------------------- stubs


def stub_result(tool: str, reason: str, output_schema: Any) -> tuple[dict[str, Any], bool | None]:
    """The stub `CallToolResult` (wire JSON) and whether its structured content validates."""
    result: dict[str, Any] = {
        "content": [{"type": "text", "text": policy.stub_reply(tool, reason)}],
        "isError": False,
        "resultType": "complete",
    }
    if not isinstance(output_schema, dict):
        return result, None
    instance, valid = valid_instance(output_schema)
    result["structuredContent"] = instance
    return result, valid


def annotations_of(tool: dict[str, Any] | None) -> dict[str, Any] | None:
    """The tool's `annotations` object exactly as the server sent it (None when absent)."""
    if tool is None:
        return None
    annotations = tool.get("annotations")
    return annotations if isinstance(annotations, dict) else None


def _never_cached(result: dict[str, Any]) -> dict[str, Any]:
    """A listing is live: the step's client may not reuse it (2026-07-28 cache hints)."""
    return {**result, "ttlMs": 0, "cacheScope": "private"}


def _error_result(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True, "resultType": "complete"}


# --------------------------------------------------------------------------- one endpoint


class Endpoint:
    """The step-facing MCP server for one upstream: `/mcp/<name>`."""

    def __init__(self, proxy: McpProxy, upstream: Upstream) -> None:
        self.proxy = proxy
        self.upstream = upstream
        self.name = upstream.name
        server: Server[Any] = Server(
            f"sandbox-guard/{self.name}",
            version="1",
            instructions=f"Test mode: calls to {self.name} are checked by the sandbox guard.",
        )
        server.add_request_handler("tools/call", types.CallToolRequestParams, self._call_tool)
        self.lists = {method: self._forward_list(method) for method in FORWARDED_LISTS}
        for method, forward in self.lists.items():
            server.add_request_handler(method, types.PaginatedRequestParams, forward)
        server.add_request_handler(
            "resources/read", types.ReadResourceRequestParams, self._read_resource
        )
        server.add_request_handler("prompts/get", types.GetPromptRequestParams, self._get_prompt)
        # The gate only: the SDK's default OpenTelemetry middleware costs time per
        # request and the guard exports no traces.
        server.middleware = [self._gate]
        self.server = server
        self.security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
        )
        # No idle expiry: a session the step uses only through the hot path has no
        # request in flight on the SDK's side and would expire under it. Instead a
        # cap on open sessions (503 past it, logged by the hot path).
        self.manager = StreamableHTTPSessionManager(
            app=server,
            json_response=True,
            security_settings=self.security,
            session_idle_timeout=None,
            max_sessions=MAX_SESSIONS,
        )
        self.hot = HotPath(self)

    # -- the gate: what the step may ask at all --------------------------------------

    async def _gate(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        if ctx.request_id is None or ctx.method in SERVED:
            return await call_next(ctx)
        await self.proxy.log_line(
            tool=f"mcp:{self.name}/{ctx.method}",
            decision="refuse",
            reason=f"MCP method {ctx.method} is not served in test mode",
            arguments=dict(ctx.params or {}),
            started=time.perf_counter(),
            detail={"server": self.name, "method": ctx.method},
        )
        raise MCPError(
            code=types.METHOD_NOT_FOUND,
            message=f"{ctx.method} is not available through the test-mode guard",
        )

    # -- tools/call ----------------------------------------------------------------------

    async def _call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> HandlerResult:
        return await self.call_tool(params)

    async def call_tool(self, params: types.CallToolRequestParams) -> dict[str, Any]:
        """One call, inside one of the guard's forward slots: its tool listing and its
        result are what the guard holds for it (see caps). The SDK's handler and the
        hot path both end here, so their policy and log lines are one code."""
        started = time.perf_counter()
        budget = self.proxy.config.budget_for(f"mcp:{self.name}/{params.name}")
        try:
            async with self.proxy.forward_slot(budget):
                return await self._judged_call(params, started, budget)
        except SlotTimeout:
            reason = f"the guard had no free forward slot within {budget:g} s"
            await self.proxy.log_line(
                tool=f"mcp:{self.name}/{params.name}",
                decision="stub",
                reason=reason,
                arguments=dict(params.arguments or {}),
                started=started,
                detail={"server": self.name, "tool": params.name},
            )
            return stub_result(params.name, reason, None)[0]

    async def _judged_call(
        self, params: types.CallToolRequestParams, started: float, budget: float
    ) -> dict[str, Any]:
        tool = params.name
        arguments = dict(params.arguments or {})
        override = self.upstream.server.read_only_overrides.get(tool)
        lookup_budget = self.upstream.server.lookup_budget_s
        detail: dict[str, Any] = {"server": self.name, "tool": tool}
        if override is not None:
            detail["override"] = {"read_only": override}
        lookup_error: str | None = None
        listed_tool: dict[str, Any] | None = None
        t0 = time.perf_counter()
        try:
            tools = await self.upstream.list_tools(lookup_budget)
            listed_tool = next((t for t in tools if t.get("name") == tool), None)
            del tools  # only this tool's entry is kept while the call runs
        except TimeoutError:
            lookup_error = f"tools/list did not answer within {lookup_budget:g} s"
        except McpServerError as exc:
            lookup_error = exc.reason
        except MCPError as exc:
            lookup_error = f"tools/list failed: {exc.message}"
        except Exception as exc:  # fail closed on anything unexpected
            lookup_error = f"tools/list failed: {_describe(exc)}"
        detail["lookup_ms"] = round((time.perf_counter() - t0) * 1000, 3)
        annotations = annotations_of(listed_tool)
        detail["listed"] = listed_tool is not None
        detail["annotations"] = annotations
        verdict = policy.decide_mcp(
            annotations,
            listed=listed_tool is not None,
            lookup_error=lookup_error,
            override_read_only=override,
        )
        if verdict.decision is not policy.Decision.ALLOW:
            schema = listed_tool.get("outputSchema") if listed_tool is not None else None
            result, valid = stub_result(tool, verdict.reason, schema)
            if valid is not None:
                detail["structured_content_valid"] = valid
            await self.proxy.log_line(
                tool=f"mcp:{self.name}/{tool}",
                decision="stub",
                reason=verdict.reason,
                arguments=arguments,
                started=started,
                detail=detail,
            )
            return result

        call = types.CallToolRequest(
            params=types.CallToolRequestParams(name=tool, arguments=params.arguments)
        )
        try:
            logged = await self.proxy.log.begin(
                session="root",
                tool=f"mcp:{self.name}/{tool}",
                decision="allow",
                reason=verdict.reason,
                category="mcp",
                arguments=arguments,
                detail=detail,
                durable=False,  # written now; the outcome's sync covers it before the reply
            )
        except LogFull as full:
            result, _ = stub_result(tool, str(full), None)
            return result
        outcome: dict[str, Any] = {}
        t1 = time.perf_counter()
        error: MCPError | None = None
        async with self.proxy.log.settled_on_exception():  # answered without an outcome
            try:
                result = await self.upstream.request(call, budget, retry=False)
            except McpReplyTooLarge as exc:
                result = _error_result(f"{tool}: {exc.reason}")
                outcome["error"] = exc.reason
                outcome["reply_too_large"] = True
            except McpServerError as exc:
                result = _error_result(f"{tool}: the MCP server {self.name} failed: {exc.reason}")
                outcome["error"] = exc.reason
            except TimeoutError:
                reason = f"no answer within its time budget of {budget:g} s"
                result = _error_result(f"{tool}: the MCP server {self.name} failed: {reason}")
                outcome["error"] = reason
            except MCPError as exc:  # a protocol error from the server: passed on as one
                error = exc
                result = {}
                outcome["error"] = f"{exc.code}: {exc.message}"[:300]
        outcome["upstream_ms"] = round((time.perf_counter() - t1) * 1000, 3)
        if result.get("isError") is True:
            outcome["is_error"] = True
        failed = error is not None or "error" in outcome or outcome.get("is_error") is True
        await self.proxy.log.outcome(logged, ok=not failed, detail=outcome)
        if error is not None:
            raise error
        return result

    # -- reads ---------------------------------------------------------------------------

    def _forward_list(
        self, method: str
    ) -> Callable[
        [ServerRequestContext[Any, Any] | None, types.PaginatedRequestParams],
        Awaitable[dict[str, Any]],
    ]:
        async def forward(
            ctx: ServerRequestContext[Any, Any] | None, params: types.PaginatedRequestParams
        ) -> dict[str, Any]:
            request = _LIST_REQUESTS[method](types.PaginatedRequestParams(cursor=params.cursor))
            deadline = self.upstream.server.lookup_budget_s * 2
            try:
                async with self.proxy.forward_slot(deadline):
                    result = await self.upstream.request(request, deadline)
            except McpServerError as exc:
                raise MCPError(
                    code=types.INTERNAL_ERROR, message=f"{self.name}: {exc.reason}"
                ) from None
            except SlotTimeout:
                raise MCPError(
                    code=types.INTERNAL_ERROR, message=f"{self.name}: the guard is busy"
                ) from None
            return _never_cached(result)

        return forward

    async def _read_resource(
        self, ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
    ) -> HandlerResult:
        request = types.ReadResourceRequest(params=types.ReadResourceRequestParams(uri=params.uri))
        result = await self._logged_read("resources/read", request, {"uri": str(params.uri)})
        return _never_cached(result)

    async def _get_prompt(
        self, ctx: ServerRequestContext[Any, Any], params: types.GetPromptRequestParams
    ) -> HandlerResult:
        request = types.GetPromptRequest(
            params=types.GetPromptRequestParams(name=params.name, arguments=params.arguments)
        )
        arguments = {"name": params.name, "arguments": dict(params.arguments or {})}
        return await self._logged_read("prompts/get", request, arguments)

    async def _logged_read(
        self, method: str, request: types.Request[Any, Any], arguments: dict[str, Any]
    ) -> dict[str, Any]:
        try:
            logged = await self.proxy.log.begin(
                session="root",
                tool=f"mcp:{self.name}/{method}",
                decision="allow",
                reason=f"MCP {method} is a read",
                category="mcp",
                arguments=arguments,
                detail={"server": self.name, "method": method},
                durable=False,  # written now; the outcome's sync covers it before the reply
            )
        except LogFull as full:
            raise MCPError(code=types.INTERNAL_ERROR, message=str(full)) from None
        failure: MCPError | None = None
        budget = self.proxy.config.budget_for(method)
        async with self.proxy.log.settled_on_exception():  # answered without an outcome
            try:
                async with self.proxy.forward_slot(budget):
                    result = await self.upstream.request(request, budget)
            except McpServerError as exc:
                failure = MCPError(code=types.INTERNAL_ERROR, message=f"{self.name}: {exc.reason}")
            except (TimeoutError, SlotTimeout):
                reason = f"no answer within {budget:g} s"
                failure = MCPError(code=types.INTERNAL_ERROR, message=f"{self.name}: {reason}")
            except MCPError as exc:
                failure = exc
        outcome: dict[str, Any] = {}
        if failure is not None:
            outcome["error"] = f"{failure.code}: {failure.message}"[:300]
        await self.proxy.log.outcome(logged, ok=failure is None, detail=outcome)
        if failure is not None:
            raise failure
        return result


# --------------------------------------------------------------------------- the hot path

_HOT_METHODS = frozenset({"tools/call", "tools/list", "ping"})
_HOT_PARAMS = {"tools/call": {"name", "arguments"}, "tools/list": {"cursor"}, "ping": set()}
_ENVELOPE_KEYS = {"jsonrpc", "id", "method", "params"}
_ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Fallback(Exception):
    """Not a request the hot path answers: the SDK's transport gets it whole."""


class HotPath:
    """The endpoint's front: the few requests a step repeats, answered without the
    SDK's session machinery; everything else goes to the SDK unchanged.

    Answered here: a POST whose body is exactly one plain JSON-RPC request
    (`tools/call` with only `name`/`arguments`, `tools/list` with at most a
    `cursor`, `ping` without params), in a session the SDK opened and whose
    `initialize` it answered with a result, on the handshake-era protocol version
    that session negotiated (`Mcp-Protocol-Version` equal to it), with the Host,
    Origin, Content-Type and Accept the SDK's transport would accept. The answer is
    built by the same handlers (`Endpoint.call_tool`, the list forwarders: the same
    policy, action-log lines and errors), shaped by the SDK's own result
    serializer for that version and dumped as the SDK's transport dumps it, so a
    client sees the same bytes either way.

    Everything else, bytes unchanged (a body already read is replayed): the
    opening `initialize`, notifications, responses, batches, DELETE, GET (SSE),
    any other method, odd or malformed bodies, an unknown or ended session, the
    2026-07-28 era. The SDK's answers to those, errors included, are its own. Its
    503 past `MAX_SESSIONS` is logged here."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.sdk: _ASGIApp = endpoint.manager.handle_request
        self.enabled = True  # tests turn it off to get the SDK's answer for the same call
        self._security = TransportSecurityMiddleware(endpoint.security)
        self._versions: dict[str, str] = {}  # session id -> the version it negotiated

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled or scope["type"] != "http" or scope["method"] != "POST":
            await self._to_sdk(scope, receive, send, opening=False)
            return
        headers: dict[bytes, bytes] = {}
        for key, value in scope["headers"]:
            headers.setdefault(key, value)  # a repeated header: the SDK reads the first too
        session = headers.get(b"mcp-session-id")
        version = self._ready(session, headers)
        if session is None or version is None:
            await self._to_sdk(scope, receive, send, opening=session is None)
            return
        body, complete, _ = await caps.read_capped_body(
            receive, self.endpoint.manager.max_request_body_size
        )
        try:
            if not complete:
                raise _Fallback
            answer = await self._answer(body, version)
        except _Fallback:
            await self._to_sdk(scope, _replay(body, complete, receive), send, opening=False)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-length", str(len(answer)).encode()),
                    (b"content-type", b"application/json"),
                    (b"mcp-session-id", session),
                ],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    def _ready(self, session: bytes | None, headers: dict[bytes, bytes]) -> str | None:
        """The session's negotiated version when this request may be answered here."""
        if session is None:
            return None
        sid = session.decode("latin-1")
        version = self._versions.get(sid)
        transport = self.endpoint.manager._server_instances.get(sid)
        if version is None or transport is None or transport.is_terminated:
            return None
        if headers.get(b"mcp-protocol-version", b"").decode("latin-1") != version:
            return None
        if sid in self.endpoint.manager._session_owners:
            return None  # a credential-bound session: the SDK checks its owner
        content_type = headers.get(b"content-type", b"").decode("latin-1").lower()
        if content_type.split(";")[0].strip() != CONTENT_TYPE_JSON:
            return None
        if not self._security._validate_host(_text(headers.get(b"host"))):
            return None
        if not self._security._validate_origin(_text(headers.get(b"origin"))):
            return None
        accept = [
            part.split(";")[0].strip().lower()
            for part in headers.get(b"accept", b"").decode("latin-1").split(",")
        ]
        if not any(kind in (CONTENT_TYPE_JSON, "application/*", "*/*") for kind in accept):
            return None
        return version

    async def _answer(self, body: bytes, version: str) -> bytes:
        """The JSON-RPC reply to one plain request, or _Fallback for anything else."""
        try:
            message = pydantic_core.from_json(body)  # the SDK's parser, the SDK's depth limit
        except ValueError:
            raise _Fallback from None
        if not isinstance(message, dict) or not message.keys() <= _ENVELOPE_KEYS:
            raise _Fallback
        method, request_id = message.get("method"), message.get("id")
        if message.get("jsonrpc") != "2.0" or method not in _HOT_METHODS:
            raise _Fallback
        if isinstance(request_id, bool) or not isinstance(request_id, int | str):
            raise _Fallback
        params = message.get("params", {})
        if not isinstance(params, dict) or not params.keys() <= _HOT_PARAMS[method]:
            raise _Fallback
        endpoint = self.endpoint
        try:
            if method == "tools/call":
                name, arguments = params.get("name"), params.get("arguments")
                if not isinstance(name, str) or not isinstance(arguments, dict | None):
                    raise _Fallback
                call = types.CallToolRequestParams(name=name, arguments=arguments)
                result: dict[str, Any] = await endpoint.call_tool(call)
            elif method == "tools/list":
                cursor = params.get("cursor")
                if not isinstance(cursor, str | None):
                    raise _Fallback
                page = types.PaginatedRequestParams(cursor=cursor)
                result = await endpoint.lists[method](None, page)
            else:
                result = {}
            hint = endpoint.server.cache_hints.get(method)
            if hint is not None:
                result = {"ttlMs": hint.ttl_ms, "cacheScope": hint.scope, **result}
            try:
                wire = _methods.serialize_server_result(method, version, dict(result))
            except ValidationError:
                raise MCPError(
                    code=types.INTERNAL_ERROR, message="Handler returned an invalid result"
                ) from None
            # The bytes `JSONRPCResponse(...).model_dump_json(by_alias=True,
            # exclude_unset=True)` gives (the tests compare them), without the model.
            return pydantic_core.to_json({"jsonrpc": "2.0", "id": request_id, "result": wire})
        except MCPError as exc:
            reply: types.JSONRPCMessage = types.JSONRPCError(
                jsonrpc="2.0", id=request_id, error=exc.error
            )
        except _Fallback:
            raise
        except Exception as exc:  # as the SDK's dispatcher answers a handler's crash
            error = types.ErrorData(code=0, message=str(exc))
            reply = types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)
        return reply.model_dump_json(by_alias=True, exclude_unset=True).encode()

    async def _to_sdk(self, scope: Scope, receive: Receive, send: Send, *, opening: bool) -> None:
        """The SDK's transport; an opening request's reply is watched: a result to
        `initialize` makes its session one the hot path serves, a 503 (the session
        cap) is logged."""
        if not opening:
            await self.sdk(scope, receive, send)
            return
        status = 0
        session: str | None = None
        body = bytearray()

        async def watch(message: Message) -> None:
            nonlocal status, session
            if message["type"] == "http.response.start":
                status = message["status"]
                for key, value in message.get("headers", []):
                    if key.lower() == b"mcp-session-id":
                        session = value.decode("latin-1")
            elif message["type"] == "http.response.body" and len(body) < 65536:
                body.extend(message.get("body", b""))
            await send(message)

        await self.sdk(scope, receive, watch)
        if status == 503:
            await self.endpoint.proxy.log_line(
                tool=f"mcp:{self.endpoint.name}",
                decision="refuse",
                reason=f"too many open MCP sessions (at most {MAX_SESSIONS} per server)",
                arguments={},
                started=time.perf_counter(),
                detail={"server": self.endpoint.name, "max_sessions": MAX_SESSIONS},
                category="request",
            )
        if status != 200 or session is None:
            return
        with contextlib.suppress(ValueError):
            result = json.loads(body).get("result")
            version = result.get("protocolVersion") if isinstance(result, dict) else None
            if isinstance(version, str) and version in HANDSHAKE_PROTOCOL_VERSIONS:
                self._versions[session] = version
        live = self.endpoint.manager._server_instances
        for gone in [sid for sid in self._versions if sid not in live]:
            del self._versions[gone]


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def _replay(body: bytes, complete: bool, receive: Receive) -> Receive:
    """`receive` as if nothing had been read from it yet."""
    pending = [{"type": "http.request", "body": body, "more_body": not complete}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay


# --------------------------------------------------------------------------- the proxy


class _Authorized:
    """ASGI wrapper: the run's bridge token, or 401 (and a log line)."""

    def __init__(self, proxy: McpProxy, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.proxy = proxy
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.proxy.authorized(scope):
            response = await self.proxy.reject(scope, 401, BAD_TOKEN)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class McpProxy:
    """Every configured server's endpoint, upstream session and (stdio, with an allow
    list) egress proxy.

    `listeners`: each stdio server's socket, already listening (the guard binds them
    first thing); a missing one is bound here. `egress_listeners`: the egress socket
    of each stdio server with an `egress` allow list. `slots`: the guard's forward
    slots (see caps), shared with the bridge."""

    def __init__(
        self,
        config: GuardConfig,
        log: ActionLog,
        *,
        slots: asyncio.Semaphore | None = None,
        listeners: dict[str, socket.socket] | None = None,
        egress_listeners: dict[str, socket.socket] | None = None,
    ) -> None:
        self.config = config
        self.log = log
        self._slots = slots or asyncio.Semaphore(caps.FORWARD_SLOTS)
        given = dict(listeners or {})
        self._egress_listeners = dict(egress_listeners or {})
        self.upstreams: dict[str, Upstream] = {}
        for server in config.mcp_servers:
            listener = None
            if server.command is not None:
                listener = given.pop(server.name, None) or bind_unix(
                    f"{config.mcp_dir}/{server.name}/{MCP_SOCKET}"
                )
            uid = config.mcp_uids.get(server.name)
            self.upstreams[server.name] = Upstream(server, listener, uid)
        self.endpoints = {name: Endpoint(self, up) for name, up in self.upstreams.items()}

    @contextlib.asynccontextmanager
    async def forward_slot(self, budget_s: float) -> AsyncIterator[None]:
        """One of the guard's forward slots, waited for within the call's own budget
        (SlotTimeout past it)."""
        if not self._slots.locked():  # a free slot: taken without a wait (no timer)
            await self._slots.acquire()
        else:
            try:
                with anyio.fail_after(budget_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise SlotTimeout() from None
        try:
            yield
        finally:
            self._slots.release()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        from sandbox.guard import egress  # the step's proxy code, with each server's list

        async with contextlib.AsyncExitStack() as stack:
            for endpoint in self.endpoints.values():
                await stack.enter_async_context(endpoint.manager.run())
            for name, listener in self._egress_listeners.items():
                server = self.upstreams[name].server
                config = self.config.model_copy(update={"egress": server.own_egress()})
                proxy = egress.EgressProxy(config, self.log, label={"mcp_server": name})
                unix_server = await egress.listen(proxy, listener)
                stack.callback(proxy.close)
                stack.callback(unix_server.close)
            async with anyio.create_task_group() as tg:
                for upstream in self.upstreams.values():
                    tg.start_soon(upstream.supervise)
                with anyio.move_on_after(STARTUP_WAIT_S):
                    for upstream in self.upstreams.values():
                        await upstream.wait_first_attempt()
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
        for upstream in self.upstreams.values():
            upstream.close()

    def routes(self) -> list[BaseRoute]:
        routes: list[BaseRoute] = [
            Route(MCP_PATH, self._index, methods=["GET"]),
            Route(MCP_PATH + "/", self._index, methods=["GET"]),
        ]
        for name, endpoint in self.endpoints.items():
            routes.append(Route(f"{MCP_PATH}/{name}", _Authorized(self, endpoint.hot)))
        routes.append(
            Route(MCP_PATH + "/{rest:path}", self._unknown, methods=["GET", "POST", "DELETE"])
        )
        return routes

    # -- helpers for the endpoints -------------------------------------------------------

    def authorized(self, scope: Scope) -> bool:
        given = b""
        for key, value in scope.get("headers", []):
            if key == b"authorization":
                given = value
                break
        return bearer_ok(given, self.config.bridge_token)

    async def reject(self, scope: Scope, status: int, reason: str) -> Response:
        tool = f"mcp:{scope.get('path', '?')}"
        return await reject_and_log(
            self.log, status, reason, tool=tool, session="root", started=time.perf_counter()
        )

    async def log_line(
        self,
        *,
        tool: str,
        decision: str,
        reason: str,
        arguments: dict[str, Any],
        started: float,
        detail: dict[str, Any] | None = None,
        category: str = "mcp",
    ) -> None:
        await self.log.write(
            session="root",
            tool=tool,
            decision=decision,
            reason=reason,
            category=category,
            arguments=arguments,
            duration_ms=(time.perf_counter() - started) * 1000,
            detail=detail,
        )

    async def _index(self, request: Request) -> Response:
        if not self.authorized(request.scope):
            return await self.reject(request.scope, 401, BAD_TOKEN)
        base = str(request.url).rstrip("/")
        return JSONResponse(
            {"servers": [{"name": name, "url": f"{base}/{name}"} for name in self.endpoints]}
        )

    async def _unknown(self, request: Request) -> Response:
        if not self.authorized(request.scope):
            return await self.reject(request.scope, 401, BAD_TOKEN)
        name = request.path_params.get("rest", "")
        known = ", ".join(self.endpoints) or "none"
        return await self.reject(
            request.scope, 404, f"no MCP server {json.dumps(name)} in this run (known: {known})"
        )
