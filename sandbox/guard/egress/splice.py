"""Zero-copy relay for the egress proxy: socket -> pipe -> socket inside the kernel.

Once the proxy has judged a request, the reply is only bytes to pass on. Copying
them through Python (recv into a buffer, the stream reader's buffer, send) costs
the 1-CPU guard more than the transfer itself; `splice(2)` moves them without
ever entering user space. It runs in a thread of its own per relay (never the
shared default executor, which a few slow downloads would fill), on duplicates
of the sockets' descriptors, so the event loop closing its transports can never
leave the thread holding a number that now names another socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import select
import socket
import threading
from asyncio.trsock import TransportSocket

AVAILABLE = hasattr(os, "splice")
PIPE_BYTES = 1024 * 1024
POLL_MS = 200  # how soon a relay notices it was told to stop
# A counted body's relay wakes only once this many of its bytes are queued (SO_RCVLOWAT,
# never more than what is left of the body): it then moves them in one splice each way,
# instead of one splice, one TCP push and one wake-up of the step per few packets.
LOWAT_BYTES = 256 * 1024
# ...but it never holds bytes back longer than this: a body that trickles in goes out
# as it arrives, this late at most. EOF and errors wake it at once whatever is queued.
LOWAT_HOLD_MS = 2
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
# The congestion control of the step's connections to the guard (see `unpaced`). Reno is
# built into every kernel and open to unprivileged sockets whatever the host allows.
LOOPBACK_CONGESTION = b"reno"


def unpaced(listener: socket.socket | TransportSocket) -> None:
    """Give the connections `listener` accepts a congestion control that does not pace.

    A host whose default is BBR, with no fq qdisc (the guard's loopback has none), has
    TCP pace every socket's sends with a timer of its own. On the step's loopback there is
    no bottleneck to pace for, yet a 100 MiB reply fired that timer some 24,000 times a
    second, each time an interrupt, on the two CPUs the step, the guard and the upstream
    share: the relay lost about a fifth of its rate to it. Set on the listener, because an
    accepted connection starts with its listener's choice, and a connection that started
    with BBR keeps pacing after a switch. Both of the step's ways in are set: the proxy's
    port and the listener the firewall redirects its direct connections to (paced, the
    sends of a redirected 100 MiB GET, fired from a timer on either CPU, reached the step
    out of order: tens to hundreds of segments per GET retransmitted for nothing). Best
    effort: a kernel without it just paces."""
    if listener.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, LOOPBACK_CONGESTION)


def _poller(fd: int, events: int) -> select.poll:
    """A poll set watching `fd` for `events`, made once per relay and direction."""
    poller = select.poll()
    poller.register(fd, events)
    return poller


def _wait(poller: select.poll, stop: threading.Event) -> bool:
    """Until `poller`'s descriptor is ready (or hung up); False once told to stop."""
    while not stop.is_set():
        if poller.poll(POLL_MS):
            return True
    return False


class _Lowat:
    """The receive low-water mark of the socket a relay reads (SO_RCVLOWAT), set on a
    duplicate of its descriptor and put back to 1 (the default) when the relay ends: the
    socket may go back to the pool and be read by the event loop again."""

    def __init__(self, fd: int) -> None:
        self._sock = socket.socket(fileno=os.dup(fd))
        self.level = 1

    def set(self, level: int) -> None:
        level = max(1, level)
        if level != self.level:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, level)
            self.level = level

    def close(self) -> None:
        try:
            self.set(1)
        except OSError:
            pass
        finally:
            self._sock.close()


def _held(poller: select.poll, stop: threading.Event) -> bool:
    """Whether `poller`'s descriptor became readable (its low-water mark reached, EOF or
    an error) within LOWAT_HOLD_MS; False on time out or when told to stop."""
    return not stop.is_set() and bool(poller.poll(LOWAT_HOLD_MS))


def _splice(
    src: int,
    dst: int,
    count: int,
    wait_for: select.poll,
    stop: threading.Event,
    lowat: _Lowat | None = None,
) -> int | None:
    """One splice of up to `count` bytes, waiting on `wait_for` (the poll set of the
    descriptor it waits on) while it is not ready; the bytes moved (0 at end of
    stream), or None once told to stop.
    With `lowat` above 1 the first wait is at most LOWAT_HOLD_MS; after it the mark
    drops to 1, so bytes that arrive slowly are not held back."""
    while True:
        try:
            return os.splice(src, dst, count, flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
        except BlockingIOError:
            if lowat is not None and lowat.level > 1:
                if not _held(wait_for, stop):
                    lowat.set(1)
            elif not _wait(wait_for, stop):
                return None


def _relay(src_fd: int, dst_fd: int, stop: threading.Event, limit: int | None) -> int:
    """Move what `src_fd` sends to `dst_fd` until end of stream, or until `limit` bytes
    have moved; the bytes moved. Only a counted relay (a body of known length) sets a
    low-water mark: a tunnel's or a close-delimited body's bytes may be a conversation,
    each of them awaited."""
    moved = 0
    pipe_r, pipe_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    lowat = None
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(pipe_w, F_SETPIPE_SZ, PIPE_BYTES)
        lowat = _Lowat(src_fd) if limit is not None else None
        readable, writable = _poller(src_fd, select.POLLIN), _poller(dst_fd, select.POLLOUT)
        while limit is None or moved < limit:
            want = PIPE_BYTES if limit is None else min(PIPE_BYTES, limit - moved)
            if lowat is not None:
                lowat.set(min(LOWAT_BYTES, want))
            got = _splice(src_fd, pipe_w, want, readable, stop, lowat)
            if not got:
                break
            while got:
                sent = _splice(pipe_r, dst_fd, got, writable, stop)
                if sent is None:
                    return moved
                got -= sent
                moved += sent
                # Part of it went: the socket's send buffer is full, and a splice now
                # would only say so (EAGAIN); wait until it takes more first.
                if got and not _wait(writable, stop):
                    return moved
        return moved
    except OSError:  # reset, broken pipe: the relay ends, as a copy loop would
        return moved
    finally:
        if lowat is not None:
            lowat.close()
        os.close(pipe_r)
        os.close(pipe_w)


async def relay(src: socket.socket, dst: socket.socket, limit: int | None = None) -> int:
    """Splice `src` into `dst` until `src` ends or `limit` bytes have moved; the bytes
    moved. Never more than `limit`: a reply's body ends exactly where its length says,
    so the connection can carry the next reply. Cancel to stop early."""
    src_fd, dst_fd = os.dup(src.fileno()), os.dup(dst.fileno())
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    stop = threading.Event()

    def run() -> None:
        moved = 0
        try:
            moved = _relay(src_fd, dst_fd, stop, limit)
        finally:
            os.close(src_fd)
            os.close(dst_fd)
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(_settle, done, moved)

    threading.Thread(target=run, name="egress-splice", daemon=True).start()
    try:
        return await asyncio.shield(done)
    finally:
        stop.set()


def _settle(future: asyncio.Future[int], moved: int) -> None:
    if not future.done():
        future.set_result(moved)
