"""Keep-alive through the egress proxy, both sides: the step's client keeps its
connection to the proxy, the proxy keeps its connection to the host, each request is
still judged and logged on its own, and no request is ever sent twice.

The proxy is the guard's real code on loopback; the host is a fake outside server
(tests/fakes/keepalive_host.py) that counts its connections; the clients are httpx
and requests, as steps use them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import uvloop

from sandbox.collect.actionsummary import read
from sandbox.contracts.config import Egress
from sandbox.contracts.wire import ActionLine
from sandbox.guard.egress import http1
from sandbox.guard.egress.pool import Pool, Upstream
from sandbox.guard.egress.proxy import EgressProxy
from tests.conftest import in_process_guard
from tests.fakes.keepalive_host import KeepAliveHost, big_body
from tests.polling import wait_for


@dataclass
class Proxied:
    url: str  # the proxy's
    proxy: EgressProxy
    actions: Path
    accepted: list[int]  # client connections the proxy accepted (one item, a counter)

    def lines(self) -> list[ActionLine]:
        return [ActionLine.model_validate_json(x) for x in self.actions.read_text().splitlines()]


@pytest.fixture
def host() -> Iterator[KeepAliveHost]:
    server = KeepAliveHost()
    yield server
    server.close()


@contextlib.contextmanager
def proxy_for(tmp_path: Path, host: KeepAliveHost, *, per_call: bool = False) -> Iterator[Proxied]:
    allow = [{"host": "127.0.0.1", "port": host.port}]
    guard = in_process_guard(tmp_path, per_call=per_call, egress=Egress(allow=allow))  # type: ignore[arg-type]
    proxy = EgressProxy(guard.config, guard.log)
    accepted = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        await proxy.handle(reader, writer)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    start = asyncio.start_server(handle, "127.0.0.1", 0, limit=http1.MAX_HEAD_BYTES)
    server = asyncio.run_coroutine_threadsafe(start, loop).result(10)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Proxied(f"http://127.0.0.1:{port}", proxy, guard.actions, accepted)
    finally:

        async def stop() -> None:
            server.close()
            proxy.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:  # handlers finishing their last lines, or idle on a client still open
                _, idle = await asyncio.wait(tasks, timeout=1)
                for task in idle:
                    task.cancel()
                await asyncio.gather(*idle, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        guard.log.close()


def test_a_thousand_requests_each_from_httpx_and_requests_reuse_both_connections(
    tmp_path: Path, host: KeepAliveHost
) -> None:
    n = 1000
    base = f"http://127.0.0.1:{host.port}/len"
    failures: dict[str, list[str]] = {"httpx": [], "requests": []}
    with proxy_for(tmp_path, host, per_call=True) as proxied:
        with httpx.Client(proxy=proxied.url, timeout=20, trust_env=False) as client:
            for i in range(n):
                try:
                    reply = client.get(f"{base}/h{i}")
                    assert reply.status_code == 200 and reply.text == f"hello /len/h{i}"
                except Exception as exc:
                    failures["httpx"].append(f"{i}: {type(exc).__name__}: {exc}")
        with requests.Session() as session:
            session.trust_env = False
            session.proxies = {"http": proxied.url}
            for i in range(n):
                try:
                    got = session.get(f"{base}/r{i}", timeout=20)
                    assert got.status_code == 200 and got.text == f"hello /len/r{i}"
                except Exception as exc:
                    failures["requests"].append(f"{i}: {type(exc).__name__}: {exc}")
        lines = proxied.lines()
        accepted = proxied.accepted[0]
        reuses = proxied.proxy.upstream_reuses
    assert failures == {"httpx": [], "requests": []}
    # every request reached the host exactly once, over one upstream connection
    paths = [path for _, _, path in host.seen.requests]
    assert paths == [f"/len/h{i}" for i in range(n)] + [f"/len/r{i}" for i in range(n)]
    # (a second only if the next client's first request came while the last one's
    # reply was still being finished)
    assert host.seen.connections <= 2 and reuses == 2 * n - host.seen.connections
    # one connection from each client to the proxy, and each request logged on its own
    assert accepted == 2
    starts = [ln for ln in lines if ln.event == "start"]
    assert len(starts) == 2 * n and all(ln.decision == "allow" for ln in starts)
    assert {ln.detail["connection"] for ln in starts[:n]} == {1}
    assert {ln.detail["connection"] for ln in starts[n:]} == {2}
    assert sum(1 for ln in starts if ln.detail.get("upstream_reused")) == reuses
    counts = read(proxied.actions).counts
    assert (counts.allow, counts.outcome_unknown, counts.outcome_error) == (2 * n, 0, 0)


@pytest.mark.parametrize(
    ("kind", "reused"),
    [
        ("len", True),
        ("chunked", True),
        ("close", False),
        ("http10", False),
        ("extra", False),
        ("split", True),
        ("splitextra", False),
    ],
)
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_an_upstream_connection_is_reused_only_after_a_cleanly_framed_reply(
    tmp_path: Path, host: KeepAliveHost, kind: str, reused: bool, method: str
) -> None:
    with (
        proxy_for(tmp_path, host) as proxied,
        httpx.Client(proxy=proxied.url, timeout=20, trust_env=False) as client,
    ):
        for i in range(3):
            reply = client.request(method, f"http://127.0.0.1:{host.port}/{kind}/{i}")
            assert reply.status_code == 200
            assert reply.text == ("" if method == "HEAD" else f"hello /{kind}/{i}")
            if "extra" in kind:
                # A HEAD's reply has no body to end it, so the proxy can relay it before
                # a second send of stray bytes left the host; the next request goes once
                # they are on the proxy's side (stray bytes that come after a reuse:
                # test_stray_bytes_that_arrive_after_a_reuse_...).
                wait_for(lambda: host.seen.strays_sent > i, 10, f"reply {i}'s stray bytes")  # noqa: B023
        accepted = proxied.accepted[0]
    assert [path for _, _, path in host.seen.requests] == [f"/{kind}/{i}" for i in range(3)]
    assert host.seen.connections == (1 if reused else 3)
    assert accepted == 1  # the client's connection to the proxy carried all three


def test_stray_bytes_that_arrive_after_a_reuse_fail_that_request_and_retire_the_connection(
    tmp_path: Path, host: KeepAliveHost
) -> None:
    """A host that sends bytes nobody asked for only after the proxy reused its
    connection: they come ahead of the next reply, so that reply cannot be told apart
    from them. The request gets the proxy's 502 (never the host's bytes as its reply),
    it was sent once, and the next request goes on a new connection."""
    with (
        proxy_for(tmp_path, host) as proxied,
        httpx.Client(proxy=proxied.url, timeout=20, trust_env=False) as client,
    ):
        first = client.get(f"http://127.0.0.1:{host.port}/lateextra/a")
        second = client.get(f"http://127.0.0.1:{host.port}/len/b")
        third = client.get(f"http://127.0.0.1:{host.port}/len/c")
    lines = proxied.lines()  # the proxy has stopped: every outcome is written
    assert (first.status_code, first.text) == (200, "hello /lateextra/a")
    assert second.status_code == 502 and "was sent but failed" in second.text
    assert (third.status_code, third.text) == (200, "hello /len/c")
    assert host.seen.requests == [
        (1, "GET", "/lateextra/a"),
        (1, "GET", "/len/b"),
        (2, "GET", "/len/c"),
    ]
    (start,) = [ln for ln in lines if ln.arguments.get("url", "").endswith("/len/b")]
    (outcome,) = [ln for ln in lines if ln.event == "outcome" and ln.call_id == start.call_id]
    assert start.detail.get("upstream_reused") is True and outcome.outcome == "error"


def test_spliced_bodies_end_exactly_where_their_length_says_on_both_kept_connections(
    tmp_path: Path, host: KeepAliveHost
) -> None:
    """Bodies past the splice threshold move in the kernel; the relay never reads past
    one, so the next reply on the same upstream connection, and the next request on the
    client's, arrive whole. Stray bytes after a spliced body stay with the host's
    connection, which is then not reused."""
    kinds = ["big/1000000", "len", "big/700001", "len", f"big/{65 * 1024 + 1}", "len"]
    # around the size whose rest the proxy reads itself after a head (at most 64 KiB)
    kinds += [f"big/{64 * 1024}", "len", f"big/{64 * 1024 + 300}", "split"]
    kinds += ["bigextra/900000", "len", "big/800000"]
    with (
        proxy_for(tmp_path, host) as proxied,
        httpx.Client(proxy=proxied.url, timeout=20, trust_env=False) as client,
    ):
        for i, kind in enumerate(kinds):
            reply = client.get(f"http://127.0.0.1:{host.port}/{kind}/{i}")
            assert reply.status_code == 200
            size = int(kind.split("/")[1]) if "/" in kind else None
            assert reply.content == (big_body(size) if size else f"hello /{kind}/{i}".encode())
        accepted = proxied.accepted[0]
        reuses = proxied.proxy.upstream_reuses
    assert [path for _, _, path in host.seen.requests] == [
        f"/{kind}/{i}" for i, kind in enumerate(kinds)
    ]
    # the stray bytes retired the first connection; every other request reused one
    assert host.seen.connections == 2 and reuses == len(kinds) - 2
    assert accepted == 1


def test_an_idle_connection_the_host_closed_is_not_reused(
    tmp_path: Path, host: KeepAliveHost
) -> None:
    with (
        proxy_for(tmp_path, host) as proxied,
        httpx.Client(proxy=proxied.url, timeout=20, trust_env=False) as client,
    ):
        assert client.get(f"http://127.0.0.1:{host.port}/len/a").text == "hello /len/a"
        host.drop_connections()  # the host's idle timeout, while the proxy holds it
        assert client.get(f"http://127.0.0.1:{host.port}/len/b").text == "hello /len/b"
    assert [c for c, _, _ in host.seen.requests] == [1, 2]


def test_a_request_that_failed_on_a_reused_connection_is_never_sent_again(
    tmp_path: Path, host: KeepAliveHost
) -> None:
    """The host took the request and closed without a reply: it may have acted on it.
    The step gets an error, the log says sent-and-failed, the host saw it once."""
    with (
        proxy_for(tmp_path, host) as proxied,
        httpx.Client(proxy=proxied.url, timeout=20, trust_env=False) as client,
    ):
        assert client.get(f"http://127.0.0.1:{host.port}/len/a").status_code == 200
        reply = client.get(f"http://127.0.0.1:{host.port}/drop/b")
    lines = proxied.lines()  # the proxy has stopped: every outcome is written
    assert reply.status_code == 502 and "was sent but failed" in reply.text
    assert host.seen.requests == [(1, "GET", "/len/a"), (1, "GET", "/drop/b")]
    (start,) = [ln for ln in lines if ln.arguments.get("url", "").endswith("/drop/b")]
    (outcome,) = [ln for ln in lines if ln.event == "outcome" and ln.call_id == start.call_id]
    assert start.event == "start" and start.detail.get("upstream_reused") is True
    assert outcome.event == "outcome" and outcome.outcome == "error"


# -- the loop's read watch on a kept upstream socket (on uvloop, as the guard runs) ------


def _on_uvloop(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(test())


async def _turns_until(probe: Callable[[], bool], what: str, deadline_s: float = 10) -> None:
    """Let the loop run until `probe` holds (turns of the loop, with a deadline)."""
    deadline = time.monotonic() + deadline_s
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def test_a_closed_upstream_leaves_no_watch_on_the_socket_that_takes_its_number() -> None:
    """A kept connection's socket is watched from its first wait until it is closed: a
    watch left behind would make the loop's next socket with the same descriptor number
    never be read (uvloop keeps one poll handle per number), and its reply would wait
    out REPLY_TIMEOUT_S."""

    async def test() -> None:
        first, first_host = socket.socketpair()
        first.setblocking(False)
        upstream = Upstream("127.0.0.1", sock=first)
        reading = asyncio.ensure_future(upstream.recv())
        await _turns_until(lambda: upstream._waiter is not None, "the first wait")
        first_host.send(b"one")
        assert await asyncio.wait_for(reading, 10) == b"one"
        number = first.fileno()
        upstream.close()
        first_host.close()
        second, second_host = socket.socketpair()
        assert second.fileno() == number  # the lowest free number: the one just closed
        second.setblocking(False)
        reused = Upstream("127.0.0.1", sock=second)
        reading = asyncio.ensure_future(reused.recv())
        await _turns_until(lambda: reused._waiter is not None, "the second wait")
        second_host.send(b"two")
        assert await asyncio.wait_for(reading, 10) == b"two"
        reused.close()
        second_host.close()

    _on_uvloop(test)


def test_an_idle_kept_upstream_the_host_closed_wakes_the_loop_once_and_is_not_reused() -> None:
    """Idle in the pool, a watched socket that the host closes (or sends stray bytes on)
    is readable for good: the watch is dropped at its first wake-up, not run at every
    turn of the loop, and the connection is never taken again."""

    async def test() -> None:
        sock, host = socket.socketpair()
        sock.setblocking(False)
        upstream = Upstream("127.0.0.1", sock=sock)
        wakes = [0]
        readable = upstream._readable

        def counted() -> None:
            wakes[0] += 1
            readable()

        upstream._readable = counted  # type: ignore[method-assign]
        reading = asyncio.ensure_future(upstream.recv())
        await _turns_until(lambda: upstream._waiter is not None, "the wait")
        host.send(b"reply")
        assert await asyncio.wait_for(reading, 10) == b"reply"
        pool = Pool()
        pool.give_back("127.0.0.1", 80, upstream)
        host.close()  # the host's idle timeout
        await _turns_until(lambda: wakes[0] >= 2, "the wake-up for the host's close")
        for _ in range(200):
            await asyncio.sleep(0)
        assert wakes[0] == 2  # the reply's, then the close's alone
        assert pool.take("127.0.0.1", 80) is None

    _on_uvloop(test)


def test_a_reply_that_never_comes_times_out_and_a_later_one_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait for a host's bytes ends with TimeoutError at REPLY_TIMEOUT_S (the request
    then fails as timed out), the task is left with no cancel pending, and the same
    connection's next wait still reads what arrives; a wait the guard cancels (it is
    stopping) ends as a cancel, not as a timeout."""
    monkeypatch.setattr("sandbox.guard.egress.pool.REPLY_TIMEOUT_S", 0.05)

    async def test() -> None:
        sock, host = socket.socketpair()
        sock.setblocking(False)
        upstream = Upstream("127.0.0.1", sock=sock)
        task = asyncio.current_task()
        assert task is not None
        with pytest.raises(TimeoutError):
            await upstream.recv()
        assert task.cancelling() == 0
        assert upstream._waiter is None
        reading = asyncio.ensure_future(upstream.recv())
        await _turns_until(lambda: upstream._waiter is not None, "the second wait")
        host.send(b"late")
        assert await reading == b"late"
        monkeypatch.setattr("sandbox.guard.egress.pool.REPLY_TIMEOUT_S", 30.0)
        waiting = asyncio.ensure_future(upstream.recv())
        await _turns_until(lambda: upstream._waiter is not None, "the third wait")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        upstream.close()
        host.close()

    _on_uvloop(test)
