"""The guard's client for the real bridge against raw upstream servers on loopback, on the
guard's own event loop (uvloop): framing, reuse, caps, and never a second send."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
import uvloop

from sandbox.guard.bridge.client import MAX_BODY_BYTES, MAX_HEAD_BYTES, BridgeClient
from sandbox.guard.bridge.upstream import Reply, ReplyTooLarge, UpstreamError
from sandbox.guard.limits import MAX_UPSTREAM_REPLY_BYTES
from tests.guard.bridge.bridgeparts import Upstream, ok, oversized_reply

T = TypeVar("T")
DEADLINE_S = 20.0
HEADERS = {"X-Run-Kind": "test", "Content-Type": "application/json"}


def run(main: Callable[[], Awaitable[T]]) -> T:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())  # type: ignore[arg-type]


@pytest.fixture
def serve() -> Iterator[Callable[..., Upstream]]:
    made: list[Upstream] = []

    def make(answer: Callable[[int, bytes], bytes | None], **kw: bool) -> Upstream:
        made.append(Upstream(answer, **kw))
        return made[-1]

    yield make
    for upstream in made:
        upstream.close()


def _posts(url: str, bodies: list[bytes]) -> list[Reply | UpstreamError]:
    async def main() -> list[Reply | UpstreamError]:
        client = BridgeClient(url)
        out: list[Reply | UpstreamError] = []
        for body in bodies:
            try:
                out.append(await client.post("/v1/tools/call", body, HEADERS))
            except UpstreamError as exc:
                out.append(exc)
        await client.aclose()
        return out

    return run(main)


def test_kept_alive_calls_share_one_connection_and_arrive_once_each(
    serve: Callable[..., Upstream],
) -> None:
    upstream = serve(lambda n, body: ok(f"r{n}"))
    replies = _posts(upstream.url, [b'{"n": %d}' % i for i in range(5)])
    assert [r.status for r in replies if isinstance(r, Reply)] == [200] * 5
    assert [r.body for r in replies if isinstance(r, Reply)] == [
        b'{"text": "r%d"}' % (i + 1) for i in range(5)
    ]
    assert upstream.requests == [b'{"n": %d}' % i for i in range(5)]
    assert upstream.connections == 1


def test_a_reply_that_ends_with_the_close_is_read_whole_and_not_reused(
    serve: Callable[..., Upstream],
) -> None:
    upstream = serve(
        lambda n, body: b"HTTP/1.1 200 OK\r\n\r\nuntil the end", close_after_reply=True
    )
    replies = _posts(upstream.url, [b"{}", b"{}"])
    assert [(r.status, r.body) for r in replies if isinstance(r, Reply)] == [
        (200, b"until the end")
    ] * 2
    assert upstream.connections == 2


def test_an_interim_reply_is_skipped(serve: Callable[..., Upstream]) -> None:
    upstream = serve(lambda n, body: b"HTTP/1.1 100 Continue\r\n\r\n" + ok("after"))
    (reply,) = _posts(upstream.url, [b"{}"])
    assert isinstance(reply, Reply) and (reply.status, reply.body) == (200, b'{"text": "after"}')


def test_bytes_past_a_reply_retire_its_connection(serve: Callable[..., Upstream]) -> None:
    """A server that sends more than it was asked for is not trusted with the next call:
    that goes out on a new connection, and each call arrives once."""
    upstream = serve(lambda n, body: ok() + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra")
    replies = _posts(upstream.url, [b"{}", b"{}", b"{}"])
    assert all(isinstance(r, Reply) and r.body == b'{"text": "done"}' for r in replies)
    assert len(upstream.requests) == 3 and upstream.connections == 3


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n",
        b"NOT HTTP\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",  # then the close
        None,  # the connection dies after the request arrived
    ],
)
def test_a_bad_or_missing_reply_is_an_error_of_a_sent_call_never_repeated(
    serve: Callable[..., Upstream], reply: bytes | None
) -> None:
    upstream = serve(lambda n, body: reply, close_after_reply=True)
    (error,) = _posts(upstream.url, [b'{"once": true}'])
    assert isinstance(error, UpstreamError) and error.sent, error
    assert upstream.requests == [b'{"once": true}']


@pytest.mark.parametrize("framing", ["declared", "chunked"])
def test_a_reply_past_the_cap_is_refused_and_the_next_call_answered(
    serve: Callable[..., Upstream], framing: str
) -> None:
    assert MAX_BODY_BYTES == MAX_UPSTREAM_REPLY_BYTES
    big = oversized_reply(framing)
    upstream = serve(lambda n, body: big if body == b"big" else ok())
    first, second = _posts(upstream.url, [b"big", b"{}"])
    assert isinstance(first, ReplyTooLarge) and first.sent
    assert isinstance(second, Reply) and second.status == 200
    assert len(upstream.requests) == 2


def test_a_call_cut_by_its_time_budget_closes_its_connection(
    serve: Callable[..., Upstream],
) -> None:
    """The caller's time-out cancels the exchange: that connection is never reused (a
    late reply could be read as the next call's)."""
    release = threading.Event()
    calls = itertools.count(1)

    def answer(n: int, body: bytes) -> bytes:
        if next(calls) == 1:
            release.wait(DEADLINE_S)  # the first call's reply comes late
            return ok("late")
        return ok("second")

    upstream = serve(answer)

    async def main() -> Reply:
        client = BridgeClient(upstream.url)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await client.post("/v1/tools/call", b"{}", HEADERS)
        reply = await client.post("/v1/tools/call", b"{}", HEADERS)
        await client.aclose()
        return reply

    try:
        reply = run(main)
    finally:
        release.set()
    assert (reply.status, reply.body) == (200, b'{"text": "second"}')
    assert upstream.connections == 2


def test_nothing_is_sent_to_a_closed_port_and_the_call_says_so() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (error,) = _posts(f"http://127.0.0.1:{port}", [b"{}"])
    assert isinstance(error, UpstreamError) and not error.sent


@pytest.mark.parametrize("bad", ["\r\nX-Injected: 1", "\r", "\n", "\0"])
@pytest.mark.parametrize("where", ["name", "value"])
def test_a_header_with_a_line_break_is_never_written(bad: str, where: str) -> None:
    headers = {f"X-Evil{bad}": "a"} if where == "name" else {"X-Evil": f"a{bad}b"}

    async def main() -> None:
        client = BridgeClient("http://127.0.0.1:9")
        for _ in range(2):  # a refused head is refused each time, never remembered
            with pytest.raises(ValueError):
                await client.post("/v1/tools/call", b"{}", headers)

    run(main)


def test_a_header_outside_latin_1_is_never_written() -> None:
    async def main() -> None:
        client = BridgeClient("http://127.0.0.1:9")
        with pytest.raises(UnicodeEncodeError):
            await client.post("/v1/tools/call", b"{}", {"X-Name": "\u2028"})

    run(main)
