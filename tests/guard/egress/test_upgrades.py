"""Through the real proxy, against a fake host on loopback: what is not one plain
HTTP/1.1 read (an h2c upgrade, an HTTP/2 preface, a WebSocket, `Expect:
100-continue`, a body on a GET, pipelined requests) is judged as egress.spec.md says,
recorded, and never reaches the host unless the allow entry opts in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from sandbox.guard.egress.proxy import EgressProxy
from tests.guard.egress.proxyparts import (
    OK,
    Host,
    actions_file,
    allowing_proxy,
    http_lines,
    through,
)


def _head(port: int, first: str, *headers: str) -> bytes:
    authority = f"127.0.0.1:{port}"
    lines = [first.format(url=f"http://{authority}"), f"Host: {authority}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _to_host(actions: Path, *payloads: Callable[[int], bytes]) -> tuple[list[bytes], list[bytes]]:
    """Each payload (made for the host's port) on a connection of its own, through a
    proxy whose allow list is a fake host answering OK; the proxy's answers, and what
    the host received."""
    host = Host(actions, OK)
    try:
        proxy = allowing_proxy(actions, host.port)
        answers = [asyncio.run(through(proxy, payload(host.port))) for payload in payloads]
    finally:
        host.close()
    return answers, host.received


H2C = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__")
WEBSOCKET = (
    "Connection: Upgrade",
    "Upgrade: websocket",
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
    "Sec-WebSocket-Version: 13",
)


def test_an_h2c_upgrade_is_refused_and_recorded_and_never_arrives(tmp_path: Path) -> None:
    with actions_file(tmp_path) as actions:
        (answer,), received = _to_host(
            actions, lambda port: _head(port, "GET {url}/h2 HTTP/1.1", *H2C)
        )
        assert answer.startswith(b"HTTP/1.1 403 ")
        assert b"X-Agentworks-Test-Mode: refused" in answer
        assert received == []
        (line,) = http_lines(actions)
        assert line["decision"] == "refuse"
        assert "h2c" in line["reason"]
        assert line["detail"]["upgrade"] == "h2c"
        url = line["arguments"]["url"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/h2")


def test_an_http2_preface_is_refused_and_recorded(tmp_path: Path) -> None:
    with actions_file(tmp_path) as actions:
        proxy = allowing_proxy(actions, 9)
        answer = asyncio.run(through(proxy, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
        assert answer.startswith(b"HTTP/1.1 505 ")
        (line,) = http_lines(actions)
        assert line["decision"] == "refuse"
        assert "prior-knowledge" in line["reason"]
        assert line["arguments"]["first_line"].startswith("PRI * HTTP/2.0")


def test_a_websocket_is_stubbed_with_its_url_unless_the_host_opts_in(tmp_path: Path) -> None:
    with actions_file(tmp_path) as actions:
        (answer,), received = _to_host(
            actions, lambda port: _head(port, "GET {url}/ws?room=1 HTTP/1.1", *WEBSOCKET)
        )
        assert answer.startswith(b"HTTP/1.1 403 ")
        assert b"X-Agentworks-Test-Mode: stubbed" in answer
        assert received == []
        (line,) = http_lines(actions)
        assert line["decision"] == "stub"
        assert "websocket = true" in line["reason"]
        assert line["detail"]["upgrade"] == "websocket"
        url = line["arguments"]["url"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/ws?room=1")


class EchoHost:
    """A WebSocket-ish host: answers the upgrade with 101 and a greeting, then echoes
    every byte until the client closes."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._srv.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self._srv.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                self.heads.append(head)
                conn.sendall(
                    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\nSec-WebSocket-Accept: x\r\n\r\nhello"
                )
                if rest:
                    conn.sendall(rest)
                while chunk := conn.recv(65536):
                    conn.sendall(chunk)

    def close(self) -> None:
        self._srv.close()


@contextlib.contextmanager
def _echo() -> Iterator[EchoHost]:
    host = EchoHost()
    try:
        yield host
    finally:
        host.close()


def test_an_opted_in_websocket_is_relayed_both_ways_and_every_line_names_it(
    tmp_path: Path,
) -> None:
    async def session(proxy: EgressProxy, port: int) -> bytes:
        server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", server.sockets[0].getsockname()[1]
            )
            # a frame sent before the 101 arrives goes through after the head
            writer.write(_head(port, "GET {url}/ws HTTP/1.1", *WEBSOCKET) + b"early;")
            got = b""
            while not got.endswith(b"early;"):
                got += await asyncio.wait_for(reader.read(65536), 10)
            writer.write(b"late;")
            while not got.endswith(b"late;"):
                got += await asyncio.wait_for(reader.read(65536), 10)
            writer.close()
            await writer.wait_closed()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while proxy.open_connections:
                assert loop.time() < deadline, "the relay did not end with the client"
                await asyncio.sleep(0.005)
            return got
        finally:
            server.close()
            proxy.close()

    with actions_file(tmp_path) as actions, _echo() as host:
        proxy = allowing_proxy(actions, host.port, websocket=True)
        got = asyncio.run(session(proxy, host.port))
        assert got.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
        head, _, body = got.partition(b"\r\n\r\n")
        assert b"Upgrade: websocket" in head and b"Connection: Upgrade" in head
        assert body == b"helloearly;late;"
        (sent,) = host.heads
        assert b"Upgrade: websocket" in sent and b"Sec-WebSocket-Key: " in sent
        lines = [json.loads(x) for x in actions.read_text().splitlines()]
        assert [ln["event"] for ln in lines] == ["start", "outcome"]
        assert all(ln["detail"]["websocket"] is True for ln in lines)
        assert "WebSocket" in lines[0]["reason"]
        assert lines[1]["detail"]["status"] == 101


def test_expect_100_continue_on_a_stubbed_request_gets_the_stub_and_no_100(
    tmp_path: Path,
) -> None:
    with actions_file(tmp_path) as actions:
        (answer,), received = _to_host(
            actions,
            lambda port: _head(
                port, "POST {url}/e HTTP/1.1", "Content-Length: 5", "Expect: 100-continue"
            ),
        )
        assert answer.startswith(b"HTTP/1.1 403 ")  # the final answer, never a 100
        assert b" 100 " not in answer
        assert received == []
        (line,) = http_lines(actions)
        assert line["decision"] == "stub"
        assert line["arguments"]["body_note"] == "not sent: the client waited for 100"


def test_a_get_with_a_body_is_stubbed_and_one_with_transfer_encoding_refused(
    tmp_path: Path,
) -> None:
    with actions_file(tmp_path) as actions:
        (stubbed, refused), received = _to_host(
            actions,
            lambda port: _head(port, "GET {url}/g HTTP/1.1", "Content-Length: 3") + b"abc",
            lambda port: (
                _head(port, "GET {url}/g HTTP/1.1", "Transfer-Encoding: chunked")
                + b"3\r\nabc\r\n0\r\n\r\n"
            ),
        )
        assert stubbed.startswith(b"HTTP/1.1 403 ")
        assert refused.startswith(b"HTTP/1.1 400 ")
        assert received == []
        stub, refusal = http_lines(actions)
        assert (stub["decision"], stub["arguments"]["body_bytes"]) == ("stub", 3)
        assert refusal["decision"] == "refuse"


def test_pipelined_requests_are_judged_in_order_until_a_denial_closes_the_connection(
    tmp_path: Path,
) -> None:
    with actions_file(tmp_path) as actions:
        (answer,), received = _to_host(
            actions,
            lambda port: (
                _head(port, "GET {url}/one HTTP/1.1")
                + _head(port, "POST {url}/two HTTP/1.1", "Content-Length: 2")
                + b"hi"
                + _head(port, "GET {url}/three HTTP/1.1")
            ),
        )
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        assert answer.count(b"HTTP/1.1 ") == 2  # the read's reply, then the stub; then closed
        assert b"HTTP/1.1 403 " in answer
        assert [r.split(b"\r\n")[0] for r in received] == [b"GET /one HTTP/1.1"]
        decisions = [
            (ln["decision"], ln["arguments"]["url"].rsplit("/", 1)[1])
            for ln in http_lines(actions)
            if ln.get("event") != "outcome"
        ]
        assert decisions == [("allow", "one"), ("stub", "two")]  # /three was never read
