"""The egress proxy's in-kernel relay (sandbox/guard/splice.py) between real TCP sockets on
loopback, on the guard's own event loop (uvloop): exact lengths, short bodies, bodies that
trickle in, and the upstream socket left as the pool needs it; and the proxy's listener
and the firewall's redirect listener, whose connections are born with a congestion control
that does not pace."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import uvloop

from sandbox.contracts.config import Egress
from sandbox.guard.egress import proxy as egress
from sandbox.guard.egress import splice, transparent
from sandbox.guard.egress.dns import Names
from sandbox.guard.listeners import bind_loopback
from tests.conftest import in_process_guard

T = TypeVar("T")
DEADLINE_S = 20.0

pytestmark = pytest.mark.skipif(not splice.AVAILABLE, reason="no splice(2) here")


def run(main: Callable[[], Awaitable[T]]) -> T:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())  # type: ignore[arg-type]


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of one loopback TCP connection (far, near): the relay uses `near`."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        far = socket.create_connection(listener.getsockname())
        near, _ = listener.accept()
    far.settimeout(DEADLINE_S)
    near.setblocking(False)
    return far, near


@pytest.fixture
def ends() -> Iterator[tuple[socket.socket, socket.socket, socket.socket, socket.socket]]:
    """(host, upstream, client, step): the host writes `host`, the relay reads `upstream`
    and writes `client`, the step reads `step`."""
    host, upstream = tcp_pair()
    step, client = tcp_pair()
    yield host, upstream, client, step
    for sock in (host, upstream, client, step):
        sock.close()


def read_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def test_a_counted_body_moves_whole_and_the_bytes_past_it_stay_upstream(
    ends: tuple[socket.socket, ...],
) -> None:
    host, upstream, client, step = ends
    body = os.urandom(8 * 1024 * 1024 + 17)
    after = b"HTTP/1.1 200 OK\r\n"  # the next reply on a kept-alive connection
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(read_exactly(step, len(body))))
    writer = threading.Thread(target=lambda: host.sendall(body + after))
    reader.start()
    writer.start()

    async def main() -> int:
        async with asyncio.timeout(DEADLINE_S):
            return await splice.relay(upstream, client, len(body))

    assert run(main) == len(body)
    reader.join(DEADLINE_S)
    writer.join(DEADLINE_S)
    assert received == [body]
    # nothing past the body was read, and the socket reads byte by byte again
    assert upstream.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    upstream.setblocking(True)
    upstream.settimeout(DEADLINE_S)
    assert read_exactly(upstream, len(after)) == after


def test_a_body_that_trickles_in_goes_out_as_it_arrives(
    ends: tuple[socket.socket, ...],
) -> None:
    """Each piece reaches the step before the host sends the next one: the relay's
    low-water mark never holds bytes back waiting for more of a slow body."""
    host, upstream, client, step = ends
    pieces = [bytes([i]) * (100 + i) for i in range(20)]
    total = sum(len(p) for p in pieces)

    def host_and_step() -> list[bytes]:
        seen = []
        for piece in pieces:
            host.sendall(piece)
            seen.append(read_exactly(step, len(piece)))  # times out if held back
        return seen

    async def main() -> tuple[int, list[bytes]]:
        async with asyncio.timeout(DEADLINE_S):
            relay = asyncio.ensure_future(splice.relay(upstream, client, total + 1))
            seen = await asyncio.to_thread(host_and_step)
            host.sendall(b"!")
            return await relay, seen

    moved, seen = run(main)
    assert seen == pieces
    assert moved == total + 1
    assert step.recv(1) == b"!"


def test_a_short_body_ends_the_relay_when_the_host_closes(
    ends: tuple[socket.socket, ...],
) -> None:
    """Fewer bytes than announced, then EOF: the relay returns what moved at once (the
    caller records the reply as cut), however high its low-water mark stood."""
    host, upstream, client, step = ends
    body = os.urandom(300 * 1024 + 5)
    host.sendall(body)
    host.shutdown(socket.SHUT_WR)

    async def main() -> int:
        async with asyncio.timeout(DEADLINE_S):
            return await splice.relay(upstream, client, 4 * 1024 * 1024)

    assert run(main) == len(body)
    assert read_exactly(step, len(body)) == body


def test_a_relay_without_a_length_runs_to_the_close_without_a_low_water_mark(
    ends: tuple[socket.socket, ...],
) -> None:
    """A tunnel or a close-delimited body: every byte is awaited for itself (no mark is
    set), and the relay ends at EOF."""
    host, upstream, client, step = ends
    marks: list[int] = []

    def host_and_step() -> None:
        for i in range(5):
            host.sendall(b"ping %d" % i)
            assert read_exactly(step, 6) == b"ping %d" % i
            marks.append(upstream.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
        host.shutdown(socket.SHUT_WR)

    async def main() -> int:
        async with asyncio.timeout(DEADLINE_S):
            relay = asyncio.ensure_future(splice.relay(upstream, client))
            await asyncio.to_thread(host_and_step)
            return await relay

    assert run(main) == 30
    assert marks == [1] * 5


def congestion(sock: socket.socket) -> bytes:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")


def test_a_connection_the_unpaced_listener_accepts_starts_with_reno() -> None:
    """The step's connection to the proxy is born with a congestion control that does not
    pace, whatever the host's default: one chosen after the handshake would keep pacing."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        splice.unpaced(listener)
        with socket.create_connection(listener.getsockname()) as far:
            near, _ = listener.accept()
            with near:
                assert congestion(near) == splice.LOOPBACK_CONGESTION
                assert congestion(far) == congestion(socket.socket())  # only what it accepts


def test_the_proxy_s_listener_is_unpaced_before_it_accepts(tmp_path: Path) -> None:
    guard = in_process_guard(tmp_path, egress=Egress(allow=[]))
    listener = bind_loopback(0)

    async def main() -> bytes:
        async with egress.running(guard.config, guard.log, listener=listener):
            return congestion(listener)

    try:
        assert run(main) == splice.LOOPBACK_CONGESTION
    finally:
        listener.close()
        guard.log.close()


def test_the_redirect_listener_is_unpaced_before_it_accepts(tmp_path: Path) -> None:
    """The listener the firewall sends the step's direct connections to: their replies
    are spliced by the same relay as the proxy's, and were paced (the host's BBR)."""
    available = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
    others = [name for name in available if name.encode() != splice.LOOPBACK_CONGESTION]
    if not others:
        pytest.skip("no congestion control here but the loopback's own")
    guard = in_process_guard(tmp_path, egress=Egress(allow=[]))
    proxy_listener, listener = bind_loopback(0), bind_loopback(0)
    # as the listener would be on a host whose default paces, whatever this host's is
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, others[0].encode())

    async def main() -> bytes:
        async with (
            egress.running(guard.config, guard.log, listener=proxy_listener) as proxy,
            transparent.running(proxy, Names(), "key", listener),
        ):
            return congestion(listener)

    try:
        assert run(main) == splice.LOOPBACK_CONGESTION
    finally:
        proxy_listener.close()
        listener.close()
        guard.log.close()


def test_a_body_to_a_step_that_reads_slowly_moves_whole_without_failed_splices(
    ends: tuple[socket.socket, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that reads in small pieces with a small buffer fills the guard's send
    buffer again and again: each part-sent pipe-full waits until the socket takes more,
    then goes on, every byte in order; no splice into the full socket is tried only to
    fail (EAGAIN), which costs the relay a system call each time."""
    host, upstream, client, step = ends
    step.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    body = os.urandom(4 * 1024 * 1024 + 5)
    failed = [0]
    real_splice = os.splice

    def counted(src: int, dst: int, count: int, *args: object, **kwargs: object) -> int:
        try:
            return real_splice(src, dst, count, *args, **kwargs)  # type: ignore[arg-type]
        except BlockingIOError:
            if dst == sent_to[0]:
                failed[0] += 1
            raise

    sent_to = [-1]
    real_relay = splice._relay

    def noted(src_fd: int, dst_fd: int, stop: threading.Event, limit: int | None) -> int:
        sent_to[0] = dst_fd
        return real_relay(src_fd, dst_fd, stop, limit)

    monkeypatch.setattr(os, "splice", counted)  # the module calls os.splice
    monkeypatch.setattr(splice, "_relay", noted)
    received: list[bytes] = []

    def slow_reader() -> None:
        data = bytearray()
        while len(data) < len(body):
            chunk = step.recv(min(8192, len(body) - len(data)))
            if not chunk:
                break
            data += chunk
        received.append(bytes(data))

    reader = threading.Thread(target=slow_reader)
    writer = threading.Thread(target=lambda: host.sendall(body))
    reader.start()
    writer.start()

    async def main() -> int:
        async with asyncio.timeout(DEADLINE_S):
            return await splice.relay(upstream, client, len(body))

    assert run(main) == len(body)
    reader.join(DEADLINE_S)
    writer.join(DEADLINE_S)
    assert received == [body]
    assert failed[0] == 0
