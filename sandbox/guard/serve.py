"""The guard's server: uvicorn on the bridge port, the egress proxy beside it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from types import FrameType

import uvicorn

from sandbox.guard.actionlog import ActionLog
from sandbox.guard.bridge import Guard, build_app
from sandbox.guard.caps import TRANSPORT_MAX_HEAD_BYTES
from sandbox.guard.config import READY_MARK, GuardConfig


class GuardServer(uvicorn.Server):
    """uvicorn, plus two things the runner waits on in every run.

    Ready: one line on stdout once the bridge, MCP proxy and egress proxy serve.
    Stop: SIGTERM to an idle guard (no request, bridge call or egress connection
    open) exits at once. uvicorn's graceful shutdown pauses at least 0.1 s, often
    0.2, with nothing to finish: every action line is written before its call is
    answered. A busy guard shuts down gracefully (uvicorn's own shutdown).
    """

    def __init__(self, config: uvicorn.Config, guard: Guard) -> None:
        super().__init__(config)
        self._guard = guard
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if not self.should_exit:
            print(READY_MARK, flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between any two bytecodes; decide between two loop
        # callbacks instead, where no action line can be half made.
        if sig == signal.SIGTERM and self._loop is not None and not self.should_exit:
            self._loop.call_soon_threadsafe(self._exit_if_idle, sig)
            return
        super().handle_exit(sig, frame)

    def _exit_if_idle(self, sig: int) -> None:
        state = self.server_state
        if not state.connections and not state.tasks and self._guard.idle():
            self._guard.log.close()
            os._exit(0)
        super().handle_exit(sig, None)


def serve(
    raw_config: bytes,
    *,
    bridge: socket.socket,
    egress: socket.socket,
    mcp: dict[str, socket.socket] | None = None,
    mcp_egress: dict[str, socket.socket] | None = None,
) -> int:
    """Serve until stopped, on sockets that already listen; the exit status.

    `mcp` / `mcp_egress`: each stdio MCP server's socket and egress socket."""
    config = GuardConfig.model_validate_json(raw_config)
    log = ActionLog(
        config.actions_path,
        secrets=(config.bridge_token, config.exec_token),
        fsync_each=config.fsync_each,
        step=config.step,
    )
    guard = Guard(config, log)
    app = build_app(
        guard, egress_listener=egress, mcp_listeners=mcp or {}, mcp_egress_listeners=mcp_egress
    )
    server = GuardServer(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
            http="h11",
            h11_max_incomplete_event_size=TRANSPORT_MAX_HEAD_BYTES,
            # The step is the only client and sits on loopback, which uvicorn trusts for
            # X-Forwarded-* by default: no rewriting of the client address on its word.
            proxy_headers=False,
            server_header=False,  # one header less per reply; nothing reads it
        ),
        guard,
    )
    server.run(sockets=[bridge])
    return 0 if server.started else 1
