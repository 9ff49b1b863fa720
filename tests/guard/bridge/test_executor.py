"""What an executor-routed call costs on the guard-executor connection, counted by the kernel.

The real executor (its own process, as the step container runs it) and the real guard
(in this process, its bridge app and its client) over loopback. A DB query or a file
read is one round trip: one connection kept for every call, one TCP segment with the
request and one with the reply. A request or a reply written in two parts is two
segments, and a reply's second part was held back by Nagle until the guard's delayed
ACK (~40 ms a call); a new connection a call is a handshake more. The counts are the
kernel's (`TCP_INFO` of the guard's socket), not timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandbox.contracts.guardconfig import GuardConfig
from sandbox.contracts.wire import ToolResult
from sandbox.guard.actionlog import ActionLog
from sandbox.guard.app import build_app
from sandbox.guard.bridge import executor as executor_module
from sandbox.guard.bridge.routes import Guard
from sandbox.guard.limits import MAX_EXEC_REPLY_BYTES
from testbed.ports import free_ports
from tests.conftest import BRIDGE_TOKEN, guard_config
from tests.fakes.loopback import LoopbackServer
from tests.guard.bridge.bridgeparts import ok
from tests.polling import wait_for

REPO = Path(__file__).resolve().parents[3]
AUTH = {"Authorization": f"Bearer {BRIDGE_TOKEN}"}
CALLS = 6  # of each tool

# struct tcp_info (linux/tcp.h, append-only): tcpi_data_segs_in, tcpi_data_segs_out.
TCP_INFO_BYTES = 160
DATA_SEGS_AT = 152


def data_segments(sock: socket.socket) -> tuple[int, int]:
    """(segments with data received, sent) on `sock` since it was opened."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
    if len(info) < TCP_INFO_BYTES:
        pytest.skip("this kernel's TCP_INFO has no data segment counts")
    received, sent = struct.unpack_from("II", info, DATA_SEGS_AT)
    return received, sent


def sockets_to(port: int) -> list[socket.socket]:
    """This process's TCP sockets connected to 127.0.0.1:`port`, each once however many
    descriptors it has (duplicates: close them)."""
    found: dict[str, socket.socket] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:") or link in found:
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.getpeername() == ("127.0.0.1", port):
                found[link] = sock
                continue
        except OSError:
            pass
        sock.close()
    return list(found.values())


@pytest.fixture
def executor(tmp_path: Path) -> Iterator[GuardConfig]:
    """The real executor serving a group folder with a DB copy and a file, its step
    waiting on stdin; the config of a guard that routes to it."""
    root = tmp_path / "group"
    root.mkdir()
    (root / "notes.txt").write_text("one\ntwo\n")
    db = tmp_path / "copy.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE jobs (id INTEGER, title TEXT)")
        conn.execute("INSERT INTO jobs VALUES (1, 'a'), (2, 'b')")
    conn.close()
    actions = tmp_path / "actions.jsonl"
    actions.touch()
    (port,) = free_ports(1)
    config = guard_config(actions, exec_port=port, has_db=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(REPO),
        "AGENTWORKS_EXEC_PORT": str(port),
        "AGENTWORKS_EXEC_TOKEN": config.exec_token,
        "DB_PATH": str(db),
    }
    step = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    process = subprocess.Popen(
        [sys.executable, "-m", "sandbox.stepside.agentworks_exec", "--", *step],
        cwd=root,
        env=env,
        stdin=subprocess.PIPE,
    )
    try:
        wait_for(lambda: _listens(port), 30, "the executor to listen")
        yield config
    finally:
        assert process.stdin is not None
        process.stdin.close()  # the step ends, and the executor with it
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_a_db_query_or_file_read_is_one_round_trip_on_one_kept_connection(
    executor: GuardConfig,
) -> None:
    calls: list[tuple[str, dict[str, Any]]] = [
        ("query_workflow_db", {"sql": "SELECT id, title FROM jobs ORDER BY id"}),
        ("read_file", {"path": "notes.txt"}),
    ] * CALLS
    guard = Guard(executor, ActionLog(executor.actions_path, secrets=(BRIDGE_TOKEN,)))

    async def main() -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
        transport = httpx.ASGITransport(app=build_app(guard))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://guard") as client:
                replies = []
                for tool, arguments in calls:
                    r = await client.post(
                        "/v1/tools/call", json={"tool": tool, "arguments": arguments}, headers=AUTH
                    )
                    replies.append(r.json())
            # Counted while the guard still holds its connection.
            held = sockets_to(executor.exec_port)
            counts = [data_segments(sock) for sock in held]
            for sock in held:
                sock.close()
            return replies, counts
        finally:
            await guard.close()

    replies, counts = asyncio.run(main())
    assert [r["result"]["is_error"] for r in replies] == [False] * len(calls), replies
    assert "1 | a" in replies[0]["result"]["text"]
    assert replies[1]["result"]["text"] == "one\ntwo\n"
    # One connection for every call, and on it one request segment and one reply
    # segment a call: (received, sent) by the guard.
    assert counts == [(len(calls), len(calls))]


def _hostile_executor(
    reply_head: bytes, body_bytes: int
) -> tuple[socket.socket, list[int], threading.Event]:
    """A stand-in for an executor the step took over: it answers every connection with
    `reply_head` and then up to `body_bytes` of body, counting what the guard let it
    send; the event is set when the guard refused the rest (reset or closed)."""
    server = socket.create_server(("127.0.0.1", 0))
    sent = [0]
    refused = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply_head)
                chunk = b"x" * 65536
                try:
                    while sent[0] < body_bytes:
                        sent[0] += conn.send(chunk)
                except OSError:
                    refused.set()

    threading.Thread(target=serve, daemon=True).start()
    return server, sent, refused


def _kernel_buffers() -> int:
    """The most loopback TCP can hold between a sender and a reader that stopped: the
    largest send and receive buffers the kernel autotunes to."""
    total = 0
    for name in ("tcp_wmem", "tcp_rmem"):
        total += int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
    return total


@pytest.mark.parametrize("declared", [True, False])
def test_a_reply_over_the_executors_cap_is_dropped_not_held(tmp_path: Path, declared: bool) -> None:
    """The executor runs as the step: its reply is as hostile as the step, and the guard
    reads no more of it than MAX_EXEC_REPLY_BYTES (a declared length over it, or a body
    that keeps coming)."""
    over = MAX_EXEC_REPLY_BYTES + 1
    head = b"HTTP/1.1 200 OK\r\n" + (
        b"Content-Length: %d\r\n\r\n" % over if declared else b"Connection: close\r\n\r\n"
    )
    # Whatever the guard stops reading stays in the kernel's buffers: beyond those and
    # the cap, the sender can only go on if the guard kept reading.
    bound = MAX_EXEC_REPLY_BYTES + _kernel_buffers()
    server, sent, refused = _hostile_executor(head, 2 * bound)
    actions = tmp_path / "actions.jsonl"
    actions.touch()
    config = guard_config(actions, exec_port=server.getsockname()[1], has_db=True)
    guard = Guard(config, ActionLog(str(actions), secrets=(BRIDGE_TOKEN,)))
    outcome: dict[str, Any] = {}

    async def main() -> ToolResult:
        try:
            return await guard.executor.run("read_file", {"path": "big"}, outcome)
        finally:
            await guard.close()

    try:
        result = asyncio.run(main())
    finally:
        server.close()
    assert result.is_error and "the guard's cap" in result.text
    assert outcome["reply_bytes"] == f"more than {MAX_EXEC_REPLY_BYTES}"
    # The guard stopped reading and refused the rest.
    assert refused.wait(timeout=30), sent[0]
    assert sent[0] <= bound, sent[0]


def test_a_call_past_its_wait_ends_with_its_error_and_the_next_call_on_a_new_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An executor that reads a call and never answers: at the guard's wait the step
    gets the wait's error, the hung connection is closed (a late reply never answers
    the next call), and the next call is answered on a new one."""
    release = threading.Event()
    connections: list[int] = []

    def serve(conn: socket.socket, number: int) -> None:
        connections.append(number)
        with conn, contextlib.suppress(OSError):
            request = conn.recv(65536)
            if b'"hang"' in request:
                release.wait(60)
                return
            conn.sendall(ok("read"))

    server = LoopbackServer(serve)
    monkeypatch.setattr(executor_module, "exec_wait_s", lambda tool, arguments, grace: 0.2)
    actions = tmp_path / "actions.jsonl"
    actions.touch()
    config = guard_config(actions, exec_port=server.port, has_db=True)
    guard = Guard(config, ActionLog(str(actions), secrets=(BRIDGE_TOKEN,)))

    async def main() -> list[ToolResult]:
        try:
            return [
                await guard.executor.run("read_file", {"path": path}, {})
                for path in ("hang", "after")
            ]
        finally:
            await guard.close()

    try:
        hung, after = asyncio.run(main())
    finally:
        release.set()
        server.close()
    assert hung == ToolResult(text="read_file did not finish within 0.2 s", is_error=True)
    assert after == ToolResult(text="read")
    assert connections == [1, 2]
