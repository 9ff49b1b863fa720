"""The bridge API the step calls: every tool call is checked, logged, then answered.

Flow of one call: authenticate -> parse -> policy decision (on the arguments
the step controls) -> bind the tool's identity paths (`sandbox.guard.bridge.bindings`) ->
execute by route (stub, refuse, upstream, executor, session) -> action-log
line(s) -> reply. A call answered here (stub, refusal, session) is one line
before the reply; a forwarded one (upstream, executor) gets its `start` line
written before it leaves the guard and its `outcome` line before the reply (the
outcome's sync covers both: one sync per call). Nothing
raises out of a call: a refusal, a stub, an upstream failure, a reply past its
cap or a malformed request is a reply the agent can read and a log line. Only a
wrong token, a malformed or oversized request gets an HTTP error status (with
its line: see `CappedRequests`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute
from starlette.routing import Route as HttpRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox import policy
from sandbox.contracts.guardconfig import MCP_PATH, GuardConfig
from sandbox.guard import limits
from sandbox.guard.actionlog import ActionLog, LogFull, Started
from sandbox.guard.bridge import bindings
from sandbox.guard.bridge.client import BridgeClient
from sandbox.guard.gate import BAD_TOKEN, bearer_ok, reject_and_log
from sandbox.guard.upstream import Reply, ReplyTooLarge, UpstreamError
from sandbox.stepside.agentworks_exec.pathsafety import check_tool_path
from sandbox.stepside.agentworks_exec.toolargs import executor_deadline_s

if TYPE_CHECKING:
    from sandbox.guard.bridge.front import BridgeFront
    from sandbox.guard.egress import EgressProxy
from sandbox.contracts.wire import (
    RUN_KIND_HEADER,
    ExecRequest,
    SessionReply,
    SessionRequest,
    ToolCall,
    ToolReply,
    ToolResult,
    UpstreamCall,
)

ROOT_SESSION = "root"
PATH_ARGUMENTS = ("path",)


class Sessions:
    """Every session here is a test session; there is no call that makes one that is not."""

    def __init__(self) -> None:
        self._parent: dict[str, str | None] = {ROOT_SESSION: None}

    def known(self, session: str) -> bool:
        return session in self._parent

    def child(self, parent: str) -> str:
        session = f"s-{secrets.token_hex(6)}"
        self._parent[session] = parent
        return session

    def parent_of(self, session: str) -> str | None:
        return self._parent.get(session)


class Guard:
    """One run's guard: the policy check, the log, and the ways out."""

    def __init__(self, config: GuardConfig, log: ActionLog) -> None:
        self.config = config
        self.log = log
        self.sessions = Sessions()
        # Bridge calls in flight, so an egress line can name the tool call active then.
        self._inflight: dict[int, str] = {}
        self.egress: EgressProxy | None = None  # set while the app runs
        # Forwarded calls whose reply may be held in memory at once (see limits).
        self.forward_slots = asyncio.Semaphore(limits.FORWARD_SLOTS)
        self._next_call = 0
        self._upstream = BridgeClient(config.upstream) if config.upstream else None
        # The same client as the upstream's: kept alive, a request in one write, no
        # Nagle (a call is one round trip; see tests/guard/bridge/test_executor.py).
        self._executor = BridgeClient(
            f"http://127.0.0.1:{config.exec_port}", max_body=limits.MAX_EXEC_REPLY_BYTES
        )
        self._exec_headers = {
            "Authorization": f"Bearer {config.exec_token}",
            "Content-Type": "application/json",
        }

    def active_calls(self) -> list[str]:
        return sorted(set(self._inflight.values()))

    def idle(self) -> bool:
        """No bridge call in flight and no egress connection open: nothing left to record."""
        return not self._inflight and (self.egress is None or self.egress.open_connections == 0)

    async def close(self) -> None:
        if self._upstream is not None:
            await self._upstream.aclose()
        await self._executor.aclose()
        self.log.close()

    # -- HTTP handlers -----------------------------------------------------------
    # Each entry has a core that knows nothing of the HTTP framework (bytes in, status
    # and body bytes out), shared by the raw front (`sandbox.guard.bridge.front`) and the
    # framework routes behind it, so both give the same answer and the same line.

    def authorized(self, authorization: str | bytes) -> bool:
        return bearer_ok(authorization, self.config.bridge_token)

    def _authorized(self, request: Request) -> bool:
        return self.authorized(request.headers.get("authorization", ""))

    async def _body(self, request: Request) -> bytes | None:
        """The body, or None when it is larger than a bridge request may be."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.MAX_REQUEST_BYTES:
            return None
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.MAX_REQUEST_BYTES:
                return None
        return bytes(body)

    async def _reject(self, status: int, reason: str, started: float, tool: str = "?") -> Response:
        return await reject_and_log(
            self.log, status, reason, tool=tool, session="?", started=started
        )

    async def refused(
        self, status: int, reason: str, started: float, tool: str = "?"
    ) -> tuple[int, bytes]:
        """`_reject`'s line and answer, as status and body bytes."""
        response = await self._reject(status, reason, started, tool)
        return response.status_code, bytes(response.body)

    async def tools_call(self, request: Request) -> Response:
        started = time.perf_counter()
        if not self._authorized(request):
            return await self._reject(401, BAD_TOKEN, started)
        body = await self._body(request)
        if body is None:
            return await self._reject(413, too_large_request(), started)
        status, payload = await self.answer_call(body, started)
        return Response(payload, status_code=status, media_type="application/json")

    async def answer_call(self, body: bytes, started: float) -> tuple[int, bytes]:
        """One authorized tool call's whole body in, its status and reply bytes out, its
        line(s) on disk first."""
        try:
            call = ToolCall.model_validate_json(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return await self.refused(400, f"malformed request: {where}: {first['msg']}", started)
        self._next_call += 1
        call_id = self._next_call
        self._inflight[call_id] = f"{call.tool} (session {call.session or ROOT_SESSION})"
        try:
            reply, detail, category, logged = await self._handle(call, len(body))
        finally:
            del self._inflight[call_id]
        if not logged:  # a forwarded call has its start and outcome lines already;
            # a call the full log refused is counted there (as the MCP proxy does)
            await self.log.write(
                session=reply.session,
                tool=call.tool,
                decision=reply.decision,
                reason=reply.reason,
                category=category,
                arguments=bindings.without_bound(call.tool, call.arguments),
                duration_ms=(time.perf_counter() - started) * 1000,
                detail=detail,
            )
        # Serialized by pydantic straight to bytes (no dict, no second encoder).
        return 200, reply.model_dump_json().encode()

    async def new_session(self, request: Request) -> Response:
        started = time.perf_counter()
        if not self._authorized(request):
            return await self._reject(401, BAD_TOKEN, started)
        status, payload = await self.answer_session(await self._body(request), started)
        return Response(payload, status_code=status, media_type="application/json")

    async def answer_session(self, body: bytes | None, started: float) -> tuple[int, bytes]:
        """An authorized session request's body (None: past the cap) in, status and
        reply bytes out, its line on disk first."""
        try:
            asked = SessionRequest.model_validate_json(body or b"{}")
        except ValidationError:
            return await self.refused(400, "malformed session request", started)
        parent = asked.parent or ROOT_SESSION
        if not self.sessions.known(parent):
            return await self.refused(400, f"unknown parent session {parent!r}", started)
        session = self.sessions.child(parent)
        await self.log.write(
            session=session,
            tool="session.create",
            decision="allow",
            reason="child sessions inherit test mode",
            category="session",
            arguments={"parent": parent},
            duration_ms=(time.perf_counter() - started) * 1000,
        )
        return 200, json_bytes(SessionReply(session=session, parent=parent).model_dump())

    async def health(self, request: Request) -> Response:
        return Response(self.health_body(), media_type="application/json")

    def health_body(self) -> bytes:
        return json_bytes({"ok": True, "run_id": self.config.run_id})

    # -- one call ------------------------------------------------------------------

    async def _handle(
        self, call: ToolCall, request_bytes: int
    ) -> tuple[ToolReply, dict[str, Any], str, bool]:
        """The reply, the one-line detail, the category, and whether the call's lines
        are taken care of here (a forwarded call's start and outcome; a call the full
        log refused, which the log has counted) rather than by the caller's one line."""
        session = call.session or ROOT_SESSION
        if not self.sessions.known(session):
            reason = f"unknown session {session!r}; create one with POST /v1/sessions"
            return _refusal(call.tool, ROOT_SESSION, reason), {}, "session", False
        verdict = policy.decide(
            call.tool,
            bindings.without_bound(call.tool, call.arguments),
            has_db_copy=self.config.has_db,
        )
        detail: dict[str, Any] = {}
        if verdict.fails_step:
            detail["fails_step"] = True
        if verdict.decision is policy.Decision.STUB:
            return _stub(call.tool, session, verdict.reason), detail, verdict.category, False
        if verdict.decision is policy.Decision.REFUSE:
            refusal = _refusal(call.tool, session, verdict.reason)
            return refusal, detail, verdict.category, False

        # After the verdict, before anything runs: the tool's bound paths hold the guard's
        # values, whatever the step put there; every other argument is the step's own.
        try:
            arguments = bindings.bind(call.tool, call.arguments, self._identity(session))
        except bindings.UnboundIdentity as exc:
            return _refusal(call.tool, session, str(exc)), detail, verdict.category, False
        bound = [".".join(path) for path in bindings.IDENTITY_BINDINGS.get(call.tool, {})]
        if bound:
            detail["bound"] = bound
            overwritten = bindings.overwritten(call.tool, call.arguments)
            if overwritten:
                detail["overwrote"] = overwritten
        route = verdict.route
        decision = "redirect" if verdict.decision is policy.Decision.REDIRECT else "allow"
        if route is policy.Route.SESSION:
            child = self.sessions.child(session)
            result = ToolResult(
                text=f"{call.tool} runs inside this test run as child test session {child}; "
                "pass session={child} on its calls.",
                data={"session": child, "parent": session, "test_mode": True},
            )
            detail["child_session"] = child
            reply = ToolReply(
                ok=True,
                tool=call.tool,
                session=session,
                decision=decision,  # type: ignore[arg-type]
                reason=verdict.reason,
                result=result,
            )
            return reply, detail, verdict.category, False
        if route not in (policy.Route.LOCAL, policy.Route.DB, policy.Route.UPSTREAM):
            # a route the guard does not know: fail closed
            reason = f"no way to run route {route.value}"
            return _stub(call.tool, session, reason), detail, verdict.category, False

        if route is policy.Route.UPSTREAM:
            detail["budget_s"] = self.config.budget_for(call.tool)
        detail["request_bytes"] = request_bytes
        try:
            logged = await self.log.begin(
                session=session,
                tool=call.tool,
                decision=decision,
                reason=verdict.reason,
                category=verdict.category,
                arguments=bindings.without_bound(call.tool, call.arguments),
                detail=detail,
                durable=False,  # written now; the outcome's sync covers it before the reply
            )
        except LogFull as full:  # stubbed, never forwarded unlogged; the log counted it
            return _stub(call.tool, session, str(full)), {}, verdict.category, True
        outcome: dict[str, Any] = {}
        async with self.log.settled_on_exception():  # answered without an outcome: synced first
            if route is policy.Route.UPSTREAM:
                result = await self._forward(call.tool, arguments, session, outcome)
            else:
                result = await self._execute_in_step(call.tool, arguments, outcome)
        await self._outcome(logged, result, outcome)
        reply = ToolReply(
            ok=not result.is_error,
            tool=call.tool,
            session=session,
            decision=decision,  # type: ignore[arg-type]
            reason=verdict.reason,
            result=result,
        )
        return reply, detail, verdict.category, True

    def _identity(self, session: str) -> dict[bindings.Bound, str]:
        return {
            bindings.Bound.RUN_ID: self.config.run_id,
            bindings.Bound.SESSION: session,
            bindings.Bound.WORKFLOW: self.config.workflow,
            bindings.Bound.STEP: self.config.step,
            bindings.Bound.RUN_KIND: "test",
        }

    async def _outcome(self, logged: Started, result: ToolResult, detail: dict[str, Any]) -> None:
        if result.is_error:
            detail["error"] = result.text[:500]
        if "reply_bytes" not in detail:  # the forward counted the reply's bytes already
            detail["reply_bytes"] = len(result.text) + len(json.dumps(result.data))
        await self.log.outcome(logged, ok=not result.is_error, detail=detail)

    async def _execute_in_step(
        self, tool: str, arguments: dict[str, Any], outcome: dict[str, Any]
    ) -> ToolResult:
        """Local and DB tools run in the step's container, as the step, via its executor.

        The executor runs as the step, so its reply is as hostile as the step: read
        up to MAX_EXEC_REPLY_BYTES, never more."""
        for key in PATH_ARGUMENTS:
            if key in arguments:
                problem = check_tool_path(arguments[key])
                if problem is not None:
                    return ToolResult(text=f"refused: {problem}", is_error=True)
        timeout = exec_wait_s(tool, arguments, self.config.grace_s)
        request = ExecRequest(tool=tool, arguments=arguments)
        try:
            reply = await self._exec_post(request.model_dump_json().encode(), timeout)
        except TimeoutError:
            return ToolResult(text=f"{tool} did not finish within {timeout:g} s", is_error=True)
        except ReplyTooLarge:
            cap = limits.MAX_EXEC_REPLY_BYTES
            outcome["reply_bytes"] = f"more than {cap}"
            return ToolResult(
                text=f"{tool}: the step's tool executor replied with more than "
                f"{limits.mib(cap)} (the guard's cap); the reply was dropped",
                is_error=True,
            )
        except UpstreamError as exc:
            if not exc.sent:
                return ToolResult(
                    text=f"the step's tool executor is not reachable: {exc}", is_error=True
                )
            return ToolResult(
                text=f"the step's tool executor failed: {exc}; the call may have run "
                "and was not repeated",
                is_error=True,
            )
        outcome["reply_bytes"] = len(reply.body)
        if reply.status != 200:
            return ToolResult(
                text=f"the step's tool executor answered {reply.status}", is_error=True
            )
        try:
            return ToolResult.model_validate_json(reply.body)
        except ValidationError:
            return ToolResult(text="the step's tool executor sent a malformed reply", is_error=True)

    async def _exec_post(self, body: bytes, timeout: float) -> Reply:
        """One exchange with the executor, within `timeout` (a cancelled one closes its
        connection, so a late reply never answers the next call)."""
        async with asyncio.timeout(timeout), self.forward_slots:
            return await self._executor.post("/v1/exec", body, self._exec_headers)

    async def _forward(
        self, tool: str, arguments: dict[str, Any], session: str, detail: dict[str, Any]
    ) -> ToolResult:
        """Allowed non-local calls go to the real bridge, as the guard says who calls.

        `detail` gets the outcome's facts (status, time-out, reply size)."""
        if self._upstream is None:
            return ToolResult(text=f"{tool}: no upstream bridge is configured", is_error=True)
        budget = self.config.budget_for(tool)
        call = UpstreamCall(
            tool=tool,
            arguments=arguments,
            run_id=self.config.run_id,
            session=session,
            workflow=self.config.workflow,
            step=self.config.step,
        )
        try:
            # The whole exchange within the budget. A call whose bytes went out is never
            # sent again (sandbox.guard.upstream): the upstream may have run it.
            async with asyncio.timeout(budget), self.forward_slots:
                reply = await self._upstream.post(
                    "/v1/tools/call",
                    call.model_dump_json().encode(),
                    {RUN_KIND_HEADER: "test", "Content-Type": "application/json"},
                )
        except TimeoutError:
            detail["timed_out"] = True
            return ToolResult(
                text=f"{tool} exceeded its time budget of {budget:g} s and was abandoned",
                is_error=True,
            )
        except ReplyTooLarge:
            cap = limits.MAX_UPSTREAM_REPLY_BYTES
            detail["reply_bytes"] = f"more than {cap}"
            return ToolResult(
                text=f"{tool}: the upstream bridge's reply was larger than {limits.mib(cap)} "
                "(the guard's cap); it was dropped",
                is_error=True,
            )
        except UpstreamError as exc:
            detail["upstream_error"] = str(exc)
            if not exc.sent:
                return ToolResult(text=f"upstream bridge unreachable: {exc}", is_error=True)
            return ToolResult(
                text=f"upstream bridge failed: {exc}; the call may or may not have run "
                "upstream and was not repeated",
                is_error=True,
            )
        detail["upstream_status"] = reply.status
        body = reply.body
        detail["reply_bytes"] = len(body)
        if reply.status != 200:
            text = body[:300].decode("utf-8", errors="replace")
            return ToolResult(
                text=f"upstream bridge answered {reply.status}: {text}", is_error=True
            )
        try:
            return ToolResult.model_validate_json(body)
        except ValidationError:
            try:
                return ToolResult(text=json.dumps(json.loads(body))[:100_000])
            except ValueError:
                return ToolResult(text="upstream bridge sent a malformed reply", is_error=True)


def exec_wait_s(tool: str, arguments: dict[str, Any], grace_s: float) -> float:
    """How long the guard waits for the executor: the executor's own deadline for the
    call (`sandbox.stepside.agentworks_exec.toolargs`, the function the executor uses) plus
    the grace window."""
    return executor_deadline_s(tool, arguments) + grace_s


def json_bytes(content: Any) -> bytes:
    """JSON as the framework's JSONResponse renders it (compact, UTF-8), so every entry
    answers byte for byte alike."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode()


def too_large_request() -> str:
    return f"request larger than {limits.mib(limits.MAX_REQUEST_BYTES)} (the guard's cap)"


def refused_head(headers: list[tuple[bytes, bytes]]) -> tuple[int, str] | None:
    """Why a request is refused on its head alone, or None: 431 for header lines past
    the cap, 413 for a declared body past it (the first Content-Length). The raw front
    and `CappedRequests` both ask here, so both refuse the same heads alike."""
    if sum(len(k) + len(v) + 4 for k, v in headers) > limits.MAX_HEADER_BYTES:
        return 431, (
            f"request headers larger than {limits.mib(limits.MAX_HEADER_BYTES)} (the guard's cap)"
        )
    declared = next((v for k, v in headers if k == b"content-length"), b"")
    if declared.isdigit() and int(declared) > limits.MAX_REQUEST_BYTES:
        return 413, too_large_request()
    return None


def _stub(tool: str, session: str, reason: str) -> ToolReply:
    return ToolReply(
        ok=True,
        tool=tool,
        session=session,
        decision="stub",
        reason=reason,
        result=ToolResult(text=policy.stub_reply(tool, reason)),
    )


def _refusal(tool: str, session: str, reason: str) -> ToolReply:
    return ToolReply(
        ok=False,
        tool=tool,
        session=session,
        decision="refuse",
        reason=reason,
        result=ToolResult(text=f"TEST MODE: {tool} was refused ({reason}).", is_error=True),
    )


class CappedRequests:
    """ASGI wrapper around the whole bridge and MCP port: the step's request heads and
    bodies have caps, and passing one is an HTTP error with a line, never memory.

    Headers past MAX_HEADER_BYTES get 431; a body past MAX_REQUEST_BYTES (declared,
    or counted as it streams in) gets 413, and the application behind sees the
    client gone instead of the rest of the body. (Heads past the HTTP server's own
    fence, TRANSPORT_MAX_HEAD_BYTES, are refused before they reach this code.)"""

    def __init__(self, app: ASGIApp, log: ActionLog) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        refusal = refused_head(scope.get("headers", []))
        if refusal is not None:
            await self._refuse(scope, receive, send, *refusal, started)
            return
        seen = 0
        over = False
        responded = False

        async def counted_receive() -> Message:
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limits.MAX_REQUEST_BYTES:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal responded
            if over:
                return  # the 413 below is the only answer
            responded = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not over:
                raise
        if over and not responded:
            await self._refuse(scope, None, send, 413, too_large_request(), started)

    async def _refuse(
        self,
        scope: Scope,
        receive: Receive | None,
        send: Send,
        status: int,
        reason: str,
        started: float,
    ) -> None:
        await log_request_refusal(self.log, str(scope.get("path", "?")), reason, started)
        response = JSONResponse({"error": reason}, status_code=status)
        response.headers["Connection"] = "close"

        async def nothing() -> Message:
            return {"type": "http.disconnect"}

        await response(scope, receive or nothing, send)


async def log_request_refusal(log: ActionLog, path: str, reason: str, started: float) -> None:
    """The line of a request refused for its shape (head, size, path or method) before
    any handler ran: the tool is the path it asked for."""
    path = path[:100]
    await log.write(
        session="?",
        tool=f"mcp:{path}" if path.startswith(MCP_PATH) else path,
        decision="refuse",
        reason=reason,
        category="request",
        arguments={},
        duration_ms=(time.perf_counter() - started) * 1000,
    )


class McpSurface(Protocol):
    def running(self) -> contextlib.AbstractAsyncContextManager[None]: ...

    def routes(self) -> list[BaseRoute]: ...


class NoMcpServers:
    """The MCP endpoint of a run whose workflow configures no MCP server."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    def routes(self) -> list[BaseRoute]:
        return [HttpRoute(MCP_PATH + "{rest:path}", self._none, methods=["GET", "POST", "DELETE"])]

    async def _none(self, request: Request) -> Response:
        started = time.perf_counter()
        if not self._guard._authorized(request):
            return await self._guard._reject(401, BAD_TOKEN, started, tool="mcp")
        if request.path_params.get("rest", "").strip("/") == "" and request.method == "GET":
            return JSONResponse({"servers": []})
        return await self._guard._reject(
            404, "no MCP server is configured for this run", started, tool=f"mcp:{request.url.path}"
        )


def build_app(
    guard: Guard,
    egress_listener: socket.socket | None = None,
    *,
    mcp_listeners: dict[str, socket.socket] | None = None,
    mcp_egress_listeners: dict[str, socket.socket] | None = None,
) -> BridgeFront:
    """The bridge, the MCP proxy (under /mcp) and the egress proxy's lifetime, in one app.

    The bridge's own three paths are served by `BridgeFront` (raw ASGI, the hot path of
    every step's calls); everything else, and the app's lifespan, by the framework app
    behind it (`BridgeFront.rest`), which also still routes the bridge paths the old way.

    `egress_listener`: the egress port, already listening (the guard binds its ports
    first thing); None binds it here. `mcp_listeners` / `mcp_egress_listeners`: each
    stdio MCP server's sockets, likewise."""
    from sandbox.guard import egress

    mcp: McpSurface
    if guard.config.mcp_servers:
        from sandbox.guard.mcp.proxy import McpProxy  # the MCP SDK: only when it is needed

        mcp = McpProxy(
            guard.config,
            guard.log,
            slots=guard.forward_slots,
            listeners=mcp_listeners,
            egress_listeners=mcp_egress_listeners,
        )
    else:
        mcp = NoMcpServers(guard)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with (
            mcp.running(),
            egress.running(guard.config, guard.log, guard.active_calls, egress_listener) as proxy,
        ):
            guard.egress = proxy
            yield
        await guard.close()

    app = Starlette(
        routes=[
            HttpRoute("/v1/tools/call", guard.tools_call, methods=["POST"]),
            HttpRoute("/v1/sessions", guard.new_session, methods=["POST"]),
            HttpRoute("/v1/health", guard.health, methods=["GET"]),
            *mcp.routes(),
        ],
        lifespan=lifespan,
    )
    from sandbox.guard.bridge.front import BridgeFront

    return BridgeFront(guard, CappedRequests(app, guard.log), framework=app)
