"""The guard process from its bound sockets: config, action log and policy first,
then the network side, then the web stack.

The step's preflight waits for the guard's proof on its DNS server and its
interception listener (`sandbox.guard.egress.transparent`), which need no web
stack; importing that stack (Starlette, uvicorn, the MCP SDK) is most of the
guard's start-up. So nothing is served before the config is validated, the policy
loaded and the action log open (fail closed), then the network side serves on the
event loop while the web stack is imported in a thread; the bridge and MCP port
already listens, and a request to it waits in the backlog until the app serves.
What only a bridge call uses (the executor's and the upstream's clients, with
httptools) is imported in that thread too, before the web module that makes them.
The entry (`sandbox.guard.__main__`) loads all this with the cyclic collector off;
it is on again from the moment the network side serves.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
import signal
import socket
from collections.abc import Awaitable
from types import FrameType, ModuleType

import uvloop

from sandbox.contracts.guardconfig import GuardConfig
from sandbox.guard.actionlog import ActionLog
from sandbox.guard.bridge.routes import WAYS_OUT_MODULES, Guard
from sandbox.guard.network import serving_network

WEB_MODULE = "sandbox.guard.serve"
# What the thread imports, in order: the bridge's ways out (`Guard.upstream`,
# `Guard.executor`), then the web stack.
LATER_MODULES = (*WAYS_OUT_MODULES, WEB_MODULE)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def serve(
    raw_config: bytes,
    *,
    bridge: socket.socket,
    egress: socket.socket,
    mcp: dict[str, socket.socket] | None = None,
    mcp_egress: dict[str, socket.socket] | None = None,
    direct: tuple[socket.socket, socket.socket, socket.socket] | None = None,
    packets: socket.socket | None = None,
) -> int:
    """Serve until stopped, on sockets that already listen; the exit status.

    `mcp` / `mcp_egress`: each stdio MCP server's socket and egress socket. `direct`:
    the interception listener and the DNS server's UDP and TCP sockets. `packets`: the
    firewall's log of the step's refused packets (`sandbox.guard.nflog`)."""
    config = GuardConfig.model_validate_json(raw_config)
    log = ActionLog(
        config.actions_path,
        secrets=(config.bridge_token, config.exec_token),
        durability=config.durability,
        step=config.step,
    )
    guard = Guard(config, log)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        started = runner.run(_serving(guard, bridge, egress, mcp, mcp_egress, direct, packets))
    return 0 if started else 1


async def _serving(
    guard: Guard,
    bridge: socket.socket,
    egress: socket.socket,
    mcp: dict[str, socket.socket] | None,
    mcp_egress: dict[str, socket.socket] | None,
    direct: tuple[socket.socket, socket.socket, socket.socket] | None,
    packets: socket.socket | None,
) -> bool:
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    stopped_early = False
    try:
        async with serving_network(guard, egress, direct, packets):
            # The guard's entry keeps the collector off through its start-up
            # (`sandbox.guard.__main__`): on again from the moment the step's traffic
            # is served, so what it leaves behind is collected as it comes.
            gc.enable()

            # uvicorn handles SIGTERM once it serves; until then a stop closes the
            # network side and the log here (the guard may be PID 1, which ignores a
            # signal left to its default action). Set as uvicorn sets its own, which
            # saves and restores what it finds.
            def stop(sig: int, frame: FrameType | None) -> None:
                loop.call_soon_threadsafe(stopped.set)

            previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
            try:
                # In a thread: the loop answers the preflight's probes meanwhile.
                web = await _until(stopped, asyncio.to_thread(_import_later))
            finally:
                # uvicorn saves what it finds and re-raises a stop it handled.
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
            if web is None:
                stopped_early = True
            else:
                started: bool = await web.serve_app(
                    guard, bridge=bridge, mcp=mcp, mcp_egress=mcp_egress
                )
    finally:
        await guard.close()
    if stopped_early:
        # Every line is written and synced and nothing listens any more; the web
        # stack's import may still run in its thread, and nothing of it is needed.
        os._exit(0)
    return started


def _import_later() -> ModuleType:
    """What the guard needs only once its web stack serves (the thread's work): the web
    module, imported last."""
    for name in LATER_MODULES[:-1]:
        importlib.import_module(name)
    return importlib.import_module(LATER_MODULES[-1])


async def _until(stopped: asyncio.Event, work: Awaitable[ModuleType]) -> ModuleType | None:
    """`work`'s result, or None when `stopped` is set first."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopped.wait())
    await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if stopped.is_set():
        return None
    return task.result()
