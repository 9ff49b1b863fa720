"""One server's step-facing MCP endpoint: the SDK's server and session manager, with
the guard's handlers and its gate on what the step may ask at all.

Served: `initialize`, `ping`, `server/discover`, `tools/call` (judged, see
`calls`), the listings (forwarded, never cached by the step) and the reads
`resources/read` and `prompts/get` (forwarded and logged). Every other request
is refused with METHOD_NOT_FOUND and logged; notifications from the step are
dropped. The requests a step repeats take the hot path in front (`hotpath`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import mcp_types as types
from mcp.server import Server
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError

from sandbox.guard.actionlog import LogFull
from sandbox.guard.mcp.calls import ToolCalls
from sandbox.guard.mcp.context import McpContext, SlotTimeout
from sandbox.guard.mcp.hotpath import MAX_SESSIONS, HotPath
from sandbox.guard.mcp.relay import McpServerError, Upstream

# Requests the endpoint serves; everything else from the step is refused (and logged).
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


def _never_cached(result: dict[str, Any]) -> dict[str, Any]:
    """A listing is live: the step's client may not reuse it (2026-07-28 cache hints)."""
    return {**result, "ttlMs": 0, "cacheScope": "private"}


class Endpoint:
    """The step-facing MCP server for one upstream: `/mcp/<name>`."""

    def __init__(self, context: McpContext, upstream: Upstream) -> None:
        self.context = context
        self.upstream = upstream
        self.name = upstream.name
        self.calls = ToolCalls(context, upstream)
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
        # No idle expiry, a cap on open sessions instead (see MAX_SESSIONS).
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
        await self.context.log_line(
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
        """The SDK's handler and the hot path both end here."""
        return await self.calls.call_tool(params)

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
                async with self.context.forward_slot(deadline):
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
            logged = await self.context.log.begin(
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
        budget = self.context.config.budget_for(method)
        async with self.context.log.settled_on_exception():  # answered without an outcome
            try:
                async with self.context.forward_slot(budget):
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
        await self.context.log.outcome(logged, ok=failure is None, detail=outcome)
        if failure is not None:
            raise failure
        return result
