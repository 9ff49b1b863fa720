"""The bridge's paths answered straight from the HTTP protocol (`serve.BridgeCycle`)
against the same requests through the front's ASGI path: the same bytes on the wire
(head fields, their order, the body, 100 Continue, the close) and the same lines.

Two real uvicorn servers on loopback, each with its own in-process guard and log,
one with the guard's protocol and one with that protocol minus its direct path;
the requests are raw HTTP/1.1 bytes on real sockets, the forwarded calls go to a
real upstream server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from sandbox.contracts.wire import ActionLine
from sandbox.guard.app import build_app
from sandbox.guard.limits import MAX_REQUEST_BYTES
from sandbox.guard.serve import BridgeCycle, HeadCappedProtocol, _default_lines
from tests.guard.bridge.bridgeparts import (
    AUTH,
    REQUESTS,
    Upstream,
    call_body,
    make_guard,
    normal_line,
    ok,
    session_blind,
)

DEADLINE_S = 20.0
KEEP_ALIVE_S = 1  # the idle test's keep-alive time (uvicorn's default: 5 s)


class AsgiOnly(HeadCappedProtocol):
    """The guard's protocol with every request on ASGI (the front's `__call__`)."""

    _start_asgi_task = HttpToolsProtocol._start_asgi_task


def _chunked(size: int) -> bytes:
    """A chunked body of `size` bytes in 1 MiB chunks, without its last chunk: the
    guard reads all of it before it refuses (so its close is a FIN, not a reset)."""
    out = []
    while size > 0:
        n = min(size, 1024 * 1024)
        out.append(b"%x\r\n%s\r\n" % (n, b" " * n))
        size -= n
    return b"".join(out)


def _raw(method: str, path: str, headers: dict[str, Any], body: Any, *extra: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *extra]
    for name, value in headers.items():
        lines += [f"{name}: {one}" for one in (value if isinstance(value, list) else [value])]
    if callable(body):  # streamed past the cap, with no declared length
        lines.append("Transfer-Encoding: chunked")
        payload = _chunked(MAX_REQUEST_BYTES + 1)
    elif len(body) > MAX_REQUEST_BYTES:  # declared past the cap: refused on its head
        lines.append(f"Content-Length: {len(body)}")
        payload = b""
    else:
        lines.append(f"Content-Length: {len(body)}")
        payload = body
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + payload


# Beyond the front's table: what only a real connection shows.
EXTRA: list[tuple[str, bytes]] = [
    ("HEAD health", b"HEAD /v1/health HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("wrong method", _raw("GET", "/v1/tools/call", AUTH, b"")),
    ("trailing slash", _raw("POST", "/v1/tools/call/", AUTH, call_body("notify_user"))),
    (
        "expect 100-continue",
        _raw("POST", "/v1/tools/call", AUTH, call_body("notify_user"), "Expect: 100-continue"),
    ),
    (
        "HTTP/1.0",
        b"POST /v1/tools/call HTTP/1.0\r\nAuthorization: "
        + AUTH["Authorization"].encode()
        + b"\r\nContent-Length: %d\r\n\r\n" % len(call_body("notify_user"))
        + call_body("notify_user"),
    ),
    ("connection close", _raw("POST", "/v1/sessions", AUTH, b"{}", "Connection: close")),
]


def _replies(port: int, data: bytes, count: int) -> tuple[list[bytes], bool]:
    """Send `data` on a new connection; the raw bytes of the next `count` final replies
    (a 100 Continue is kept with the reply it precedes) and whether the guard then
    closed the connection (read to EOF only when the last reply said it would)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    with sock:
        sock.sendall(data)
        buffer = b""
        replies: list[bytes] = []
        current = b""
        closing = False
        while len(replies) < count:
            while b"\r\n\r\n" not in buffer:
                chunk = sock.recv(65536)
                assert chunk, f"closed before a reply: {buffer!r}"
                buffer += chunk
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            fields = head.lower().split(b"\r\n")
            current += head + b"\r\n\r\n"
            if fields[0].split()[1].startswith(b"1"):
                continue  # an interim reply: the final one follows
            length = next(
                (int(f.split(b":", 1)[1]) for f in fields if f.startswith(b"content-length:")),
                0,
            )
            if not data.startswith(b"HEAD "):
                while len(buffer) < length:
                    chunk = sock.recv(65536)
                    assert chunk, "closed inside a reply body"
                    buffer += chunk
                current += buffer[:length]
                buffer = buffer[length:]
            replies.append(current)
            current = b""
            closing = b"connection: close" in fields
        closed = False
        if closing:
            with contextlib.suppress(ConnectionResetError):
                closed = buffer == b"" and sock.recv(65536) == b""
        return replies, closed


def _blind(reply: bytes) -> bytes:
    head, _, body = reply.rpartition(b"\r\n\r\n")
    if not body:
        return reply
    blinded = session_blind(body)
    if blinded == body:
        return reply
    return head + b"\r\n\r\n" + blinded  # a minted session id: random on each side


class _Server:
    def __init__(self, port: int, protocols: list[HttpToolsProtocol], actions: Path) -> None:
        self.port = port
        self.protocols = protocols
        self.actions = actions

    def lines(self) -> list[dict[str, Any]]:
        text = self.actions.read_text().splitlines()
        return [normal_line(ActionLine.model_validate_json(x)) for x in text]


@contextlib.asynccontextmanager
async def _serving(
    tmp_path: Path,
    name: str,
    protocol: type[HttpToolsProtocol],
    upstream: str,
    *,
    keep_alive_s: int = 5,
) -> AsyncIterator[_Server]:
    guard, actions = make_guard(tmp_path, name, upstream)
    config = uvicorn.Config(
        build_app(guard),
        http=protocol,
        ws="none",
        lifespan="off",
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        server_header=False,
        timeout_keep_alive=keep_alive_s,
    )
    config.load()
    state = ServerState()
    made: list[HttpToolsProtocol] = []

    def factory() -> HttpToolsProtocol:
        made.append(protocol(config=config, server_state=state, app_state={}))
        return made[-1]

    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    try:
        yield _Server(server.sockets[0].getsockname()[1], made, actions)
    finally:
        server.close()
        for each in made:
            each.transport.close()
        await guard.close()


Outcome = tuple[list[bytes], bool, list[dict[str, Any]], set[type]]


async def _both(
    tmp_path: Path, exchange: Callable[[int], tuple[list[bytes], bool]]
) -> tuple[Outcome, Outcome]:
    """`exchange` against the direct server, then the ASGI one, each with a fresh guard:
    each one's replies, whether it closed, its lines, and the cycle types it ran."""
    upstream = Upstream(lambda n, body: ok(f"reply {n}"))
    results: list[Outcome] = []
    try:
        for name, protocol in (("direct", HeadCappedProtocol), ("asgi", AsgiOnly)):
            async with _serving(tmp_path, name, protocol, upstream.url) as server:
                replies, closed = await asyncio.to_thread(exchange, server.port)
                cycles = {type(p.cycle) for p in server.protocols if p.cycle is not None}
                results.append((replies, closed, server.lines(), cycles))
    finally:
        upstream.close()
    return results[0], results[1]


def _cases() -> list[tuple[str, bytes]]:
    cases = [(f"{m} {p} #{n}", _raw(m, p, h, b)) for n, (m, p, h, b) in enumerate(REQUESTS)]
    return cases + EXTRA


@pytest.mark.parametrize(("name", "request_bytes"), _cases(), ids=[c[0] for c in _cases()])
def test_a_bridge_request_gets_the_same_bytes_and_lines_as_through_asgi(
    tmp_path: Path, name: str, request_bytes: bytes
) -> None:
    direct, asgi = asyncio.run(_both(tmp_path, lambda port: _replies(port, request_bytes, 1)))
    assert [_blind(r) for r in direct[0]] == [_blind(r) for r in asgi[0]], name
    assert direct[1] == asgi[1], f"{name}: closed {direct[1]} vs {asgi[1]}"
    assert direct[2] == asgi[2], name
    path = request_bytes.split(b" ", 2)[1].decode()
    if path.rstrip("/") in ("/v1/tools/call", "/v1/sessions", "/v1/health"):
        assert direct[3] == {BridgeCycle}, name  # answered without ASGI
    else:
        assert BridgeCycle not in direct[3], name  # the app behind, as before
    assert BridgeCycle not in asgi[3]


def test_pipelined_bridge_calls_are_answered_in_order_on_one_connection(tmp_path: Path) -> None:
    """A forwarded call, a stub, a session and a refusal in one write, then a call that
    closes: every reply in order, the same bytes and lines both ways, the close last."""
    pipeline = b"".join(
        [
            _raw("POST", "/v1/tools/call", AUTH, call_body("generate_text_llm", prompt="p")),
            _raw("POST", "/v1/tools/call", AUTH, call_body("notify_user", text="hi")),
            _raw("POST", "/v1/sessions", AUTH, b"{}"),
            _raw("POST", "/v1/tools/call", {}, call_body("notify_user")),
            _raw("GET", "/v1/health", {}, b""),
            _raw("POST", "/v1/tools/call", AUTH, call_body("notify_user"), "Connection: close"),
        ]
    )
    direct, asgi = asyncio.run(_both(tmp_path, lambda port: _replies(port, pipeline, 6)))
    assert [_blind(r) for r in direct[0]] == [_blind(r) for r in asgi[0]]
    statuses = [int(r.split(b" ", 2)[1]) for r in direct[0]]
    assert statuses == [200, 200, 200, 401, 200, 200]
    assert b"reply 1" in direct[0][0]
    assert direct[1] and asgi[1]  # closed after the last
    assert direct[2] == asgi[2]
    assert [x["decision"] for x in direct[2]] == [
        "allow",
        "allow",
        "stub",
        "allow",
        "refuse",
        "stub",
    ]


def test_a_kept_alive_connection_carries_direct_and_asgi_requests_alike(tmp_path: Path) -> None:
    """Bridge paths (direct) and a path of the app behind (ASGI) on one connection,
    one after the other: the connection stays open and serves both."""

    def exchange(port: int) -> tuple[list[bytes], bool]:
        replies: list[bytes] = []
        sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
        with sock:
            for request in (
                _raw("POST", "/v1/tools/call", AUTH, call_body("notify_user")),
                _raw("GET", "/v1/nope", AUTH, b""),
                _raw("POST", "/v1/tools/call", AUTH, call_body("generate_text_llm", prompt="p")),
                _raw("GET", "/mcp", AUTH, b""),
                _raw("GET", "/v1/health", {}, b""),
            ):
                sock.sendall(request)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = sock.recv(65536)
                    assert chunk, "closed on a kept-alive connection"
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(body) < length:
                    body += sock.recv(65536)
                replies.append(head + b"\r\n\r\n" + body)
        return replies, False

    direct, asgi = asyncio.run(_both(tmp_path, exchange))
    assert [_blind(r) for r in direct[0]] == [_blind(r) for r in asgi[0]]
    assert [int(r.split(b" ", 2)[1]) for r in direct[0]] == [200, 404, 200, 200, 200]
    assert direct[2] == asgi[2]


def test_a_client_that_leaves_inside_its_body_gets_no_answer_and_no_line(tmp_path: Path) -> None:
    """Half a body, then the client's close: nothing to answer, nothing logged, both
    ways alike; the server goes on serving the next connection."""

    def exchange(port: int) -> tuple[list[bytes], bool]:
        request = _raw("POST", "/v1/tools/call", AUTH, call_body("notify_user"))
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
            sock.sendall(request[:-5])  # the head and most of the body
        return _replies(port, _raw("GET", "/v1/health", {}, b""), 1)

    direct, asgi = asyncio.run(_both(tmp_path, exchange))
    assert direct[0] == asgi[0] and b'"ok":true' in direct[0][0]
    assert direct[2] == asgi[2] == []


def test_a_kept_alive_connection_keeps_one_idle_timer_and_is_closed_once_idle(
    tmp_path: Path,
) -> None:
    """Requests on one connection, each sooner than the keep-alive time after the last
    reply: the connection serves them all on one loop timer (uvicorn's made one per
    reply), then, idle for the keep-alive time, it is closed."""
    upstream = Upstream(lambda n, body: ok(f"reply {n}"))
    timers: list[str] = []  # the keep-alive timers armed, by their callback's name
    serving: list[int] = []  # how many were armed when the last reply was in

    async def main() -> tuple[list[int], float, float]:
        loop = asyncio.get_running_loop()
        call_at, call_later = loop.call_at, loop.call_later

        def note(callback: Any) -> None:
            name = getattr(callback, "__name__", "")
            if name in ("timeout_keep_alive_handler", "_idle_check"):
                timers.append(name)

        def counted_at(when: float, callback: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
            note(callback)
            return call_at(when, callback, *args, **kw)

        def counted_later(
            delay: float, callback: Any, *args: Any, **kw: Any
        ) -> asyncio.TimerHandle:
            note(callback)
            return call_later(delay, callback, *args, **kw)

        async with _serving(
            tmp_path, "idle", HeadCappedProtocol, upstream.url, keep_alive_s=KEEP_ALIVE_S
        ) as server:
            loop.call_at, loop.call_later = counted_at, counted_later  # type: ignore[method-assign, assignment]

            def exchange(port: int) -> tuple[list[int], float, float]:
                statuses: list[int] = []
                sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
                with sock:
                    for _ in range(6):
                        sock.sendall(_raw("POST", "/v1/tools/call", AUTH, call_body("notify_user")))
                        data = b""
                        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
                            chunk = sock.recv(65536)
                            assert chunk, "closed on a kept-alive connection"
                            data += chunk
                        statuses.append(int(data.split(b" ", 2)[1]))
                    idle_from = time.monotonic()
                    serving.append(len(timers))
                    assert sock.recv(65536) == b""  # the guard's close, once idle
                    return statuses, idle_from, time.monotonic()

            try:
                return await asyncio.to_thread(exchange, server.port)
            finally:
                loop.call_at, loop.call_later = call_at, call_later  # type: ignore[method-assign]

    try:
        statuses, idle_from, closed_at = asyncio.run(main())
    finally:
        upstream.close()
    assert statuses == [200] * 6
    assert KEEP_ALIVE_S - 0.1 <= closed_at - idle_from <= KEEP_ALIVE_S + DEADLINE_S / 4
    assert serving == [1], timers  # uvicorn's protocol: 6, one per reply
    assert len(timers) <= 2  # and once more for what was left of the idle time


def test_a_reply_s_default_fields_are_the_server_s_latest() -> None:
    """uvicorn makes a new list of default fields when its date changes: a reply writes
    the list its cycle holds, never one written out for an earlier list."""
    first = [(b"date", b"Sun, 06 Dec 2026 05:00:00 GMT")]
    second = [(b"date", b"Sun, 06 Dec 2026 05:00:01 GMT"), (b"X-Extra", b"1")]
    assert _default_lines(first) == b"date: Sun, 06 Dec 2026 05:00:00 GMT\r\n"
    assert _default_lines(second) == b"date: Sun, 06 Dec 2026 05:00:01 GMT\r\nx-extra: 1\r\n"
    assert _default_lines(first) == b"date: Sun, 06 Dec 2026 05:00:00 GMT\r\n"
