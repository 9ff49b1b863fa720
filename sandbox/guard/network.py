"""The guard's network side: the egress proxy, transparent interception with the DNS
server, and the reader of the firewall's refused packets, around one action log.

None of it needs the web stack (Starlette, uvicorn, the MCP SDK), so the guard
process serves these before that stack is imported: the step's preflight probes
the DNS server and the interception listener and waits for their proof. They
start only once the guard's config is validated, its policy loaded and its action
log open (the caller builds the `Guard` first), so nothing is accepted earlier.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

from sandbox.guard.bridge.routes import Guard
from sandbox.guard.egress import proxy as egress
from sandbox.guard.egress import transparent
from sandbox.guard.egress.packets import logging_refused


@contextlib.asynccontextmanager
async def serving_network(
    guard: Guard,
    egress_listener: socket.socket | None = None,
    direct_listeners: tuple[socket.socket, socket.socket, socket.socket] | None = None,
    packets: socket.socket | None = None,
) -> AsyncIterator[None]:
    """Serve the egress proxy (on `egress_listener`; None binds it), interception and
    DNS (`direct_listeners`) and log refused `packets` until the block ends."""
    config = guard.config
    async with egress.running(config, guard.log, guard.active_calls, egress_listener) as proxy:
        guard.egress = proxy
        proxy.reads = guard.reads
        async with (
            transparent.serving(proxy, config.bridge_token, direct_listeners),
            logging_refused(guard.log, config.preflight_canaries, packets),
        ):
            yield
