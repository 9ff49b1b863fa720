"""The guard's application: the bridge, the MCP endpoint and the egress proxy around
one action log, on the bridge and MCP port.

The one module that imports the subsystems; none of them imports it. The MCP SDK
is imported only for a run with MCP servers.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute
from starlette.routing import Route as HttpRoute

from sandbox.contracts.guardconfig import MCP_PATH
from sandbox.guard.auth import BAD_TOKEN, reject_and_log
from sandbox.guard.bridge.front import BridgeFront
from sandbox.guard.bridge.routes import Guard
from sandbox.guard.egress import proxy as egress
from sandbox.guard.network import serving_network
from sandbox.guard.requestcaps import CappedRequests


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
        log = self._guard.log
        if not self._guard.authorized(request.headers.get("authorization", "")):
            return await reject_and_log(
                log, 401, BAD_TOKEN, tool="mcp", session="?", started=started
            )
        if request.path_params.get("rest", "").strip("/") == "" and request.method == "GET":
            return JSONResponse({"servers": []})
        reason = "no MCP server is configured for this run"
        tool = f"mcp:{request.url.path}"
        return await reject_and_log(log, 404, reason, tool=tool, session="?", started=started)


def build_app(
    guard: Guard,
    egress_listener: socket.socket | None = None,
    *,
    mcp_listeners: dict[str, socket.socket] | None = None,
    mcp_egress_listeners: dict[str, socket.socket] | None = None,
    direct_listeners: tuple[socket.socket, socket.socket, socket.socket] | None = None,
    packets: socket.socket | None = None,
    network: bool = True,
) -> BridgeFront:
    """The bridge, the MCP endpoint (under /mcp) and the egress proxy's lifetime, in one app.

    The bridge's three paths are the front's (`BridgeFront`); MCP, unknown paths and
    the lifespan are the framework app's behind it, inside the port's request caps.

    `egress_listener`: the egress port, already listening (the guard binds its ports
    first thing); None binds it here. `mcp_listeners` / `mcp_egress_listeners`: each
    stdio MCP server's sockets, likewise. `direct_listeners`: where the firewall sends
    the step's direct connections and DNS queries (`sandbox.guard.egress.transparent`);
    `packets`, the firewall's log of what it refused (`sandbox.guard.egress.packets`).
    `network=False`: the caller serves those (`sandbox.guard.network`) around the app
    and closes the guard; the app's lifespan then holds only the MCP side."""
    mcp: McpSurface
    if guard.config.mcp_servers:
        from sandbox.guard.mcp.proxy import McpProxy  # the MCP SDK: only when it is needed

        mcp = McpProxy(
            guard.config,
            guard.log,
            slots=guard.forward_slots,
            listeners=mcp_listeners,
            reads=guard.reads,
        )
    else:
        mcp = NoMcpServers(guard)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with (
            egress.serving_mcp_servers(guard.config, guard.log, mcp_egress_listeners or {}),
            mcp.running(),
        ):
            if not network:
                yield
                return
            async with serving_network(guard, egress_listener, direct_listeners, packets):
                yield
        await guard.close()

    app = Starlette(routes=mcp.routes(), lifespan=lifespan)
    return BridgeFront(guard, CappedRequests(app, guard.log))
