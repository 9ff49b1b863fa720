"""The egress proxy's two-phase record, in process, against real servers on loopback.

A forwarded request's `start` line is in the file before its first byte reaches the
host (so a guard killed mid-request leaves "started, outcome unknown"), its
`outcome` line follows the reply (an error when the reply is cut short); a full
log refuses the request instead of forwarding it unlogged, and counts it once;
an MCP server's proxy names the server on every line.
The upstreams stand in for the outside world: real TCP servers that record what
they receive and what the action log held at that moment.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from sandbox.collect.actionsummary import read
from sandbox.contracts.config import Egress
from sandbox.contracts.hostconfig import Durability
from sandbox.contracts.wire import ActionLine
from sandbox.guard import actionlog
from sandbox.guard.actionlog import ActionLog
from sandbox.guard.egress import proxy as proxy_module
from sandbox.guard.egress.proxy import EgressProxy
from tests.conftest import call_lines, guard_config
from tests.guard.actionlogparts import write_line
from tests.guard.egress.proxyparts import OK, Host, actions_file, allowing_proxy, through
from tests.polling import wait_for


def _closing_get(proxy: EgressProxy, port: int, path: str = "/p") -> bytes:
    """One `GET path` to the local host at `port` through the proxy, on a connection
    that closes after it; everything the proxy answers."""
    authority = f"127.0.0.1:{port}"
    request = (
        f"GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
    )
    return asyncio.run(through(proxy, request.encode()))


def _local_proxy(
    actions: Path,
    port: int,
    *,
    durability: Durability = "group",
    label: dict[str, object] | None = None,
) -> tuple[EgressProxy, ActionLog]:
    """An in-process proxy whose allow list is the local host at `port`, and its log."""
    egress = Egress(allow=[{"host": "127.0.0.1", "port": port}])  # type: ignore[list-item]
    log = ActionLog(str(actions), secrets=(), durability=durability)
    return EgressProxy(guard_config(actions, egress=egress), log, label=dict(label or {})), log


def test_a_forwarded_read_is_started_on_disk_before_its_first_byte_leaves(
    tmp_path: Path,
) -> None:
    with actions_file(tmp_path) as actions:
        host = Host(actions, OK)
        try:
            proxy, log = _local_proxy(actions, host.port)
            target = f"http://127.0.0.1:{host.port}/page"
            reply = _closing_get(proxy, host.port, "/page")
            log.close()
        finally:
            host.close()
    assert reply.startswith(b"HTTP/1.1 200 OK") and reply.endswith(b"hello")
    # When the host read the request, the log held its start line and no outcome:
    # what a guard killed at that moment leaves behind.
    (at_receipt,) = host.log_when_received
    assert [(ln.event, ln.decision, ln.arguments["url"]) for ln in at_receipt] == [
        ("start", "allow", target)
    ]
    (line,) = call_lines(actions)  # its outcome follows it
    assert line.detail["status"] == 200 and "error" not in line.detail
    outcome = ActionLine.model_validate_json(actions.read_text().splitlines()[-1])
    assert outcome.event == "outcome" and outcome.outcome == "ok"
    assert read(actions).counts.outcome_unknown == 0


def test_a_reply_cut_short_is_an_error_outcome(tmp_path: Path) -> None:
    with actions_file(tmp_path) as actions:
        host = Host(actions, b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly-some")
        try:
            proxy, log = _local_proxy(actions, host.port)
            _closing_get(proxy, host.port)
            log.close()
        finally:
            host.close()
    (line,) = call_lines(actions)
    assert line.detail["reply_cut"] is True
    assert read(actions).counts.outcome_error == 1


def test_a_blind_tunnel_is_started_before_any_byte_and_has_its_outcome(tmp_path: Path) -> None:
    with actions_file(tmp_path) as actions:
        host = Host(actions, b"from-host", tunnel=True)
        try:
            entry = {"host": "127.0.0.1", "port": host.port, "tls": True, "inspect": False}
            egress = Egress(allow=[entry])  # type: ignore[list-item]
            log = ActionLog(str(actions), secrets=(), durability="group")
            proxy = EgressProxy(guard_config(actions, egress=egress), log)
            authority = f"127.0.0.1:{host.port}"
            connect = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n"
            reply = asyncio.run(through(proxy, connect.encode() + b"tls-bytes"))
            log.close()
        finally:
            host.close()
    assert reply.startswith(b"HTTP/1.1 200 Connection Established") and reply.endswith(b"from-host")
    (at_receipt,) = host.log_when_received
    assert [(ln.event, ln.detail["tls"]) for ln in at_receipt] == [("start", "method not seen")]
    (line,) = call_lines(actions)
    assert line.arguments["method"] == "CONNECT" and line.decision == "allow"


@pytest.mark.parametrize("when", ["already full", "full at its start line"])
def test_a_full_log_refuses_the_request_and_nothing_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Already full: the host is not even dialled. Filled by the request's own start
    line: the host was dialled but gets no byte. Either way a refusal, counted once."""
    monkeypatch.setattr(actionlog, "MAX_LOG_BYTES", 1500)

    def fill(log: ActionLog) -> None:
        asyncio.run(write_line(log, "filler", reason="fill the log", arguments={"x": "x" * 200}))

    with actions_file(tmp_path) as actions:
        host = Host(actions, OK)
        try:
            egress = Egress(allow=[{"host": "127.0.0.1", "port": host.port}])  # type: ignore[list-item]
            log = ActionLog(str(actions), secrets=(), durability="group")
            if when == "already full":
                while not log.full:
                    fill(log)
            else:  # room for fillers, not for the request's start line
                while actions.stat().st_size + 400 < actionlog.MAX_LOG_BYTES:
                    fill(log)
                assert not log.full
            proxy = EgressProxy(guard_config(actions, egress=egress), log)
            reply = _closing_get(proxy, host.port)
            log.close()
        finally:
            host.close()
    expected = [] if when == "already full" else [b""]  # no byte left
    if expected:  # the host notes what a connection brought once it closes
        wait_for(lambda: host.received == expected, 10, "the proxy to close its connection")
    assert host.received == expected
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403") and b"X-Agentworks-Test-Mode: refused" in head
    assert b"action log reached its cap" in body and b"nothing was sent" in body
    assert b"Continue as if" not in body
    # Unlogged: the request, counted once (and, already full, the filler that found it so).
    assert read(actions).counts.stubbed_unlogged == (2 if when == "already full" else 1)
    assert not [ln for ln in call_lines(actions) if ln.tool == "http"]


def test_an_mcp_servers_proxy_names_the_server_on_every_line(tmp_path: Path) -> None:
    with actions_file(tmp_path) as actions:
        host = Host(actions, OK)
        try:
            proxy, log = _local_proxy(actions, host.port, label={"mcp_server": "fetcher"})
            authority = f"127.0.0.1:{host.port}"
            write = f"POST http://{authority}/w HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 2\r\n\r\nhi"
            _closing_get(proxy, host.port)
            asyncio.run(through(proxy, write.encode()))
            log.close()
        finally:
            host.close()
    raw = [ActionLine.model_validate_json(x) for x in actions.read_text().splitlines()]
    assert [ln.event for ln in raw] == ["start", "outcome", "call"]
    assert all(ln.detail["mcp_server"] == "fetcher" for ln in raw if ln.event != "outcome")
    assert [ln.decision for ln in call_lines(actions)] == ["allow", "stub"]


def test_a_stubbed_body_that_arrives_after_its_head_is_still_measured(tmp_path: Path) -> None:
    """A client may send the head and the body in two writes (Python's http.client does):
    the proxy must wait for the body, not take the end of the head for the end of the
    connection, so the stub line's size and hash are the body's."""
    body = b"secret-payload-123"
    with actions_file(tmp_path) as actions:
        egress = Egress(allow=[{"host": "127.0.0.1", "port": 9}])  # type: ignore[list-item]
        log = ActionLog(str(actions), secrets=(), durability="group")
        proxy = EgressProxy(guard_config(actions, egress=egress), log)
        waiting_for_body = asyncio.Event()
        fill = proxy._fill

        async def noting_fill(client: Any, *, idle: bool) -> bytes:
            if not idle:
                waiting_for_body.set()
            return await fill(client, idle=idle)

        proxy._fill = noting_fill  # type: ignore[method-assign]

        async def exchange() -> bytes:
            server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    b"POST http://127.0.0.1:9/effect HTTP/1.1\r\nHost: 127.0.0.1:9\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                )
                await writer.drain()
                reply = asyncio.ensure_future(reader.read())
                waited = asyncio.ensure_future(waiting_for_body.wait())
                await asyncio.wait({reply, waited}, timeout=10, return_when="FIRST_COMPLETED")
                assert waited.done() and not reply.done(), "answered before the body came"
                writer.write(body)
                await writer.drain()
                data = await asyncio.wait_for(reply, 10)
                writer.close()
                return data
            finally:
                server.close()

        reply = asyncio.run(exchange())
        log.close()
    assert reply.startswith(b"HTTP/1.1 403")
    (line,) = [ln for ln in call_lines(actions) if ln.tool == "http"]
    assert line.decision == "stub"
    assert line.arguments["body_bytes"] == len(body)
    assert line.arguments["body_sha256"] == hashlib.sha256(body).hexdigest()


def test_a_log_that_cannot_be_synced_fails_the_request_and_never_relays_its_reply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start line is written, the head sent by the log's writer (before the sync, so
    the host works while the disk syncs), then the sync fails: the host's reply is never
    relayed and the step gets an error that says why (sent but failed, never a stub)."""

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    with actions_file(tmp_path) as actions:
        host = Host(actions, OK)
        try:
            proxy, log = _local_proxy(actions, host.port, durability="per-call")
            reply = _closing_get(proxy, host.port)
            log.close()
        finally:
            host.close()
    # the head reached the host with its start line already in the file
    wait_for(lambda: host.received, 10, "the head to reach the host")
    assert host.received[0].startswith(b"GET /p HTTP/1.1\r\n")
    assert [ln.event for ln in host.log_when_received[0]] == ["start"]
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 502") and b"X-Agentworks-Test-Mode: error" in head
    assert b"action log could not be written (Input/output error)" in body
    assert b"was sent but failed" in body and b"Continue as if" not in body
    assert b"hello" not in reply


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_log_that_cannot_be_written_refuses_the_request_and_nothing_leaves(
    tmp_path: Path,
) -> None:
    """The start line's write fails (a full device): the head, which the log's writer
    sends only after the write, never leaves, and the step gets an error that says why."""
    host = Host(tmp_path / "unread.jsonl", OK)
    (tmp_path / "unread.jsonl").touch()
    try:
        egress = Egress(allow=[{"host": "127.0.0.1", "port": host.port}])  # type: ignore[list-item]
        config = guard_config(tmp_path / "unread.jsonl", egress=egress)
        log = ActionLog("/dev/full", secrets=(), durability="per-call")
        proxy = EgressProxy(config, log, label={})
        reply = _closing_get(proxy, host.port)
        log.close()
    finally:
        host.close()
    # the host was dialled before the line was written; it got no byte
    wait_for(lambda: host.received == [b""], 10, "the proxy to close its connection")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 502") and b"X-Agentworks-Test-Mode: refused" in head
    assert b"action log could not be written (No space left on device)" in body
    assert b"nothing was sent" in body and b"Continue as if" not in body


def test_an_allow_list_answer_remembered_is_the_lists_own_and_the_memo_stays_bounded(
    tmp_path: Path,
) -> None:
    """The proxy remembers which entry admits a host, port and kind (its allow list is
    frozen with its config): the same answer as the list's, for a tunnel and plain
    HTTP apart, and at most MEMO_ENTRIES of them whatever hosts the step names."""
    with actions_file(tmp_path) as actions:
        proxy = allowing_proxy(actions, 8080)
        try:
            for _ in range(2):
                entry = proxy._entry("127.0.0.1", 8080, tunnel=False)
                assert entry is not None and entry.host == "127.0.0.1"
                assert proxy._entry("127.0.0.1", 8080, tunnel=True) is None
                assert proxy._entry("127.0.0.1", 8081, tunnel=False) is None
            for n in range(proxy_module.MEMO_ENTRIES + 10):
                assert proxy._entry(f"h{n}.test", 80, tunnel=False) is None
            assert len(proxy._entries) <= proxy_module.MEMO_ENTRIES
            assert proxy._entry("127.0.0.1", 8080, tunnel=False) is entry
        finally:
            proxy.log.close()


def test_a_small_reply_and_its_request_are_rebuilt_byte_for_byte(tmp_path: Path) -> None:
    """What leaves the proxy each way, pinned whole: the request head as h11 writes it
    (Host first, the step's other end-to-end headers in order and spelling), the reply
    head rebuilt from its parse (hop-by-hop dropped, its length set, `Connection:
    close` when the proxy closes) with its small body in the same write, and the
    start line's forwarded head as the log shows it."""
    reply = (
        b"HTTP/1.1 200 Fine\r\nServer: t\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\n"
        b"Keep-Alive: timeout=5\r\nx-Mixed-CASE: v\r\nContent-Length: 5\r\n\r\nhello"
    )
    with actions_file(tmp_path) as actions:
        host = Host(actions, reply)
        try:
            proxy, log = _local_proxy(actions, host.port)
            authority = f"127.0.0.1:{host.port}"
            request = (
                f"GET http://{authority}/p?q=1 HTTP/1.1\r\nX-First: 1\r\nHost: {authority}\r\n"
                "Connection: close\r\nAccept: */*\r\nProxy-Authorization: Basic eA==\r\n\r\n"
            )
            answered = asyncio.run(through(proxy, request.encode()))
            log.close()
        finally:
            host.close()
    assert answered == (
        b"HTTP/1.1 200 Fine\r\nServer: t\r\nx-Mixed-CASE: v\r\nContent-Length: 5\r\n"
        b"Connection: close\r\n\r\nhello"
    )
    head = f"GET /p?q=1 HTTP/1.1\r\nHost: {authority}\r\nX-First: 1\r\nAccept: */*\r\n\r\n"
    assert host.received == [head.encode()]
    (line,) = call_lines(actions)
    assert line.arguments["forwarded_head"] == head.split("\r\n")[:-2]
    assert line.detail["forwarded_sha256"] == hashlib.sha256(head.encode()).hexdigest()


def test_a_plain_connection_ends_without_waiting_for_the_loop_to_release_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain TCP connection's end costs no wait of its own: every reply was drained
    into the kernel, so `close` closes it and the loop only releases the socket; the
    handler is done at once (a `wait_closed` that never returns does not hold it),
    the step reads the end of the stream, and no descriptor is left behind."""

    async def never(self: asyncio.StreamWriter) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(asyncio.StreamWriter, "wait_closed", never)

    async def exchange(proxy: EgressProxy, host: Host) -> tuple[bytes, int]:
        authority = f"127.0.0.1:{host.port}"
        server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            request = f"GET http://{authority}/p HTTP/1.1\r\nHost: {authority}\r\n\r\n"
            fds = len(os.listdir("/proc/self/fd"))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request.encode())
            data = await asyncio.wait_for(reader.readexactly(len(OK)), 20)
            writer.write_eof()  # the step is done: the proxy ends its side
            data += await asyncio.wait_for(reader.read(), 20)
            writer.transport.close()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            # the fake upstream's thread closes its side on its own time: not the proxy's
            while proxy.open_connections or len(asyncio.all_tasks()) > 1 or host.busy:
                assert loop.time() < deadline, "the proxy's handler did not finish"
                await asyncio.sleep(0.005)
            proxy.close()  # the upstream connection, if the pool kept it
            await asyncio.sleep(0)  # the loop's turn that releases the proxy's socket
            return data, len(os.listdir("/proc/self/fd")) - fds
        finally:
            server.close()
            proxy.close()

    with actions_file(tmp_path) as actions:
        host = Host(actions, OK)
        try:
            proxy, log = _local_proxy(actions, host.port)
            answered, left = asyncio.run(exchange(proxy, host))
            log.close()
        finally:
            host.close()
    assert answered == OK
    assert left == 0
