"""What the egress proxy's tests share: a raw TCP host on loopback (the outside
world, noting what the action log held when each request arrived), the run's action
log, an in-process proxy whose allow list is that host, and one exchange through it.
A helper, not a test module, so no test file imports another."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sandbox.contracts.config import Egress
from sandbox.contracts.wire import ActionLine
from sandbox.guard.actionlog import ActionLog
from sandbox.guard.egress.proxy import EgressProxy
from tests.conftest import guard_config
from tests.fakes.loopback import LoopbackServer

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"


class Host:
    """A raw TCP server: on each connection it reads up to the end of a request head (or,
    `tunnel`, the first bytes), notes the action log's lines at that moment, then sends
    `reply` and closes."""

    def __init__(self, actions: Path, reply: bytes, *, tunnel: bool = False) -> None:
        self.actions = actions
        self.reply = reply
        self.tunnel = tunnel
        self.received: list[bytes] = []
        self.log_when_received: list[list[ActionLine]] = []
        self._server = LoopbackServer(self._serve)
        self.port = self._server.port

    def _serve(self, conn: socket.socket, number: int) -> None:
        with conn, contextlib.suppress(ConnectionError):
            data = b""
            while (self.tunnel and not data) or (not self.tunnel and b"\r\n\r\n" not in data):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            lines = self.actions.read_text().splitlines()
            self.log_when_received.append([ActionLine.model_validate_json(x) for x in lines])
            self.received.append(data)
            conn.sendall(self.reply)

    @property
    def busy(self) -> int:
        """Connections still being served (the handler has not closed its socket yet)."""
        return self._server.busy

    def close(self) -> None:
        self._server.close()


@contextlib.contextmanager
def actions_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "actions.jsonl"
    path.touch()
    yield path


async def through(proxy: EgressProxy, payload: bytes) -> bytes:
    """Send `payload` to the proxy on a fresh connection; everything it answers."""
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(payload)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 20)
        writer.close()
        await writer.wait_closed()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while proxy.open_connections or len(asyncio.all_tasks()) > 1:  # its handler is done
            assert loop.time() < deadline, "the proxy's handler did not finish"
            await asyncio.sleep(0.005)
        return data
    finally:
        server.close()
        proxy.close()  # its idle upstream connections too: the proxy is done


def allowing_proxy(actions: Path, port: int, **entry: Any) -> EgressProxy:
    """An in-process proxy whose allow list is the local host at `port` (its entry's
    other fields from `entry`), logging to `actions` in group commit."""
    egress = Egress(allow=[{"host": "127.0.0.1", "port": port, **entry}])  # type: ignore[list-item]
    log = ActionLog(str(actions), secrets=(), durability="group")
    return EgressProxy(guard_config(actions, egress=egress), log)


def http_lines(actions: Path) -> list[dict[str, Any]]:
    """The log's lines for HTTP requests, as JSON objects."""
    return [json.loads(x) for x in actions.read_text().splitlines() if '"tool":"http"' in x]
