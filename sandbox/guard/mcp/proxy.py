"""The MCP surface of the guard under `/mcp`: one endpoint per configured server, the
run's bridge token on every request, and the lifetime of the upstream sessions.

`GET /mcp` lists the servers; `/mcp/<name>` is that server's streamable-HTTP
endpoint; any other name is a logged 404. Assembled here and imported by the
bridge only when the run has MCP servers (the SDK is not loaded otherwise)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from sandbox.contracts.guardconfig import MCP_PATH, GuardConfig
from sandbox.guard import limits
from sandbox.guard.actionlog import ActionLog
from sandbox.guard.auth import BAD_TOKEN, bearer_ok, reject_and_log
from sandbox.guard.listeners import bind_unix
from sandbox.guard.mcp.context import McpContext
from sandbox.guard.mcp.endpoint import Endpoint
from sandbox.guard.mcp.relay import Upstream
from sandbox.guard.recording import Reads

STARTUP_WAIT_S = 15.0  # how long the guard waits for its servers before serving
MCP_SOCKET = "mcp.sock"  # in <mcp_dir>/<name>/ (sandbox.contracts.layout.MCP_SOCKET)


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
    """Every configured server's endpoint and upstream session (a stdio server's own
    egress proxy is started by `app.py`).

    `listeners`: each stdio server's socket, already listening (the guard binds them
    first thing); a missing one is bound here. `slots`: the guard's forward
    slots (see caps), shared with the bridge."""

    def __init__(
        self,
        config: GuardConfig,
        log: ActionLog,
        *,
        slots: limits.ForwardSlots | None = None,
        listeners: dict[str, socket.socket] | None = None,
        reads: Reads | None = None,
    ) -> None:
        self.config = config
        self.log = log
        self.context = McpContext(config, log, slots)
        self.context.reads = reads
        given = dict(listeners or {})
        self.upstreams: dict[str, Upstream] = {}
        for server in config.mcp_servers:
            listener = None
            if server.command is not None:
                listener = given.pop(server.name, None) or bind_unix(
                    f"{config.mcp_dir}/{server.name}/{MCP_SOCKET}"
                )
            uid = config.mcp_uids.get(server.name)
            self.upstreams[server.name] = Upstream(server, listener, uid)
        self.endpoints = {name: Endpoint(self.context, up) for name, up in self.upstreams.items()}

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for endpoint in self.endpoints.values():
                await stack.enter_async_context(endpoint.manager.run())
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

    # -- the token and refusals ---------------------------------------------------------

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
