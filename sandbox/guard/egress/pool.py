"""The proxy's connections to real hosts: dialled to the address resolved here, and
kept alive between requests only while that is provably safe.

Names are resolved once, for allowed requests only, and the proxy dials exactly
the addresses it resolved (no rebinding window); link-local, loopback and
metadata addresses are never dialled unless the allow list names them as
addresses. A plain-TCP connection is kept for the next request to its host:port
only when its last exchange ended exactly where the reply's framing said and,
just before reuse, a poll shows neither EOF nor stray bytes (see egress.spec.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import select
import socket
import ssl
import time

from sandbox.guard.egress.connection import CHUNK
from sandbox.guard.egress.http1 import Denied

CONNECT_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 300.0  # the upstream's reply head, and each read of its body
POOL_IDLE_PER_HOST = 4  # idle upstream connections kept per host:port
POOL_IDLE_TOTAL = 32  # and per proxy
POOL_IDLE_S = 15.0  # an idle upstream connection older than this is closed, not reused
NEVER_DIAL = [
    ipaddress.ip_network(n)
    for n in (
        "169.254.0.0/16",
        "fe80::/10",
        "127.0.0.0/8",
        "::1/128",
        "0.0.0.0/8",
        "::/128",
        "100.100.100.200/32",
        "fd00:ec2::254/128",
        "224.0.0.0/4",
        "ff00::/8",
    )
]


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


class Upstream:
    """The proxy's connection to the real host, for one request."""

    def __init__(
        self,
        address: str,
        *,
        sock: socket.socket | None = None,
        streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None,
    ) -> None:
        self.address = address
        self.sock = sock  # plain TCP, never read by asyncio: its bytes can be spliced
        self._streams = streams  # TLS
        # Whether the connection may carry another request: nothing was sent on it yet,
        # or its last exchange ended cleanly (see `Pool`).
        self.reusable = True
        self.reused = False  # it came from the pool
        self.overread = False  # bytes arrived past the end of a reply
        # Plain TCP: the loop watching the socket for reads (`_readable`), kept from a
        # first wait until the socket is closed, and the wait it is for (None: none).
        self._watching: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._poller: select.poll | None = None  # `looks_open`'s

    def looks_open(self) -> bool:
        """Plain TCP with no EOF and no byte waiting: the host has not closed it and sent
        nothing unasked-for. Polled on the socket itself, just before reuse."""
        if self.sock is None or self.sock.fileno() < 0:
            return False
        if self._poller is None:  # made at the first reuse, kept for the socket's life
            self._poller = select.poll()
            self._poller.register(self.sock.fileno(), select.POLLIN | select.POLLPRI)
        return not self._poller.poll(0)

    def send_now(self, data: bytes) -> int:
        """As much of `data` as the kernel takes at once, without waiting (plain TCP):
        what the action log's writer thread runs the moment a request's start line is
        written. Nothing else uses the socket then (the loop is waiting for that line)."""
        assert self.sock is not None
        self.reusable = False  # until the exchange is seen to end cleanly
        try:
            return self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0  # the loop sends it all

    async def send(self, data: bytes) -> None:
        if not data:
            return
        self.reusable = False  # until the exchange is seen to end cleanly
        if self.sock is not None:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
        else:
            assert self._streams is not None
            self._streams[1].write(data)
            await self._streams[1].drain()

    async def recv(self, size: int = CHUNK) -> bytes:
        """The host's next bytes (b"" at its end). Plain TCP tries the socket first:
        a reply that is already there costs one recv and no turn of the loop; else the
        loop's watch on the socket (`_readable`) says when to try again."""
        if self.sock is None:
            assert self._streams is not None
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                return await self._streams[0].read(size)
        while True:
            try:  # not contextlib.suppress: an object and two calls per read
                return self.sock.recv(size)
            except (BlockingIOError, InterruptedError):
                pass
            await self._wait_readable()

    async def _wait_readable(self) -> None:
        """Until the socket is readable (data, EOF or an error), at most REPLY_TIMEOUT_S.

        The loop's reader on the socket is added at the first wait and stays until the
        socket is closed, or until it fires with no wait for it (bytes or EOF while the
        connection is idle in the pool, or while a splice thread reads it): uvloop makes
        and unmakes its poll handle with every add and remove (about eight system calls,
        three of them between the reply's arrival and its relay), so a kept-alive
        connection's requests pay for them once, not once each."""
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        if self._watching is not loop:
            self._unwatch()
            loop.add_reader(self.sock.fileno(), self._readable)
            self._watching = loop
        waiter = self._waiter = loop.create_future()
        # the waiter's own timer, not `asyncio.timeout`: nothing here but this future
        # to stop, and the context's object, task look-up and reschedule cost a kept-alive
        # GET more than the wait itself
        timer = loop.call_later(REPLY_TIMEOUT_S, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _readable(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            self._unwatch()  # nobody waits: level-triggered, it would fire every turn
        else:
            waiter.set_result(None)

    def _unwatch(self) -> None:
        loop, self._watching = self._watching, None
        if loop is not None and self.sock is not None and self.sock.fileno() >= 0:
            with contextlib.suppress(Exception):  # a loop already closed watches nothing
                loop.remove_reader(self.sock.fileno())

    def shutdown_write(self) -> None:
        with contextlib.suppress(OSError):
            if self.sock is not None:
                self.sock.shutdown(socket.SHUT_WR)
            elif self._streams is not None and self._streams[1].can_write_eof():
                self._streams[1].write_eof()

    def close(self) -> None:
        self._unwatch()  # before the descriptor's number can name another socket
        with contextlib.suppress(Exception):
            if self.sock is not None:
                self.sock.close()
            elif self._streams is not None:
                self._streams[1].close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Pool:
    """Idle plain-TCP upstream connections of one proxy, by (host, port): the most
    recently used first; at most POOL_IDLE_PER_HOST per host:port and POOL_IDLE_TOTAL
    in all, none older than POOL_IDLE_S."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[tuple[float, Upstream]]] = {}
        self.reuses = 0

    def take(self, host: str, port: int) -> Upstream | None:
        conns = self._idle.get((host, port))
        now = time.monotonic()
        while conns:
            since, upstream = conns.pop()
            if now - since < POOL_IDLE_S and upstream.looks_open():
                upstream.reused = True
                self.reuses += 1
                return upstream
            upstream.close()
        return None

    def give_back(self, host: str, port: int, upstream: Upstream) -> None:
        """Keep `upstream` for the next request to host:port if it may carry one."""
        if not upstream.reusable or upstream.sock is None:
            upstream.close()
            return
        now = time.monotonic()
        for key in list(self._idle):  # expired ones go now, not at their next use
            kept = []
            for since, conn in self._idle[key]:
                if now - since < POOL_IDLE_S:
                    kept.append((since, conn))
                else:
                    conn.close()
            if kept:
                self._idle[key] = kept
            else:
                del self._idle[key]
        conns = self._idle.setdefault((host, port), [])
        if len(conns) >= POOL_IDLE_PER_HOST:
            conns.pop(0)[1].close()
        if sum(map(len, self._idle.values())) >= POOL_IDLE_TOTAL:
            oldest = min(self._idle, key=lambda k: self._idle[k][0][0] if self._idle[k] else now)
            if self._idle[oldest]:
                self._idle[oldest].pop(0)[1].close()
        upstream.reused = False
        conns.append((now, upstream))

    def close(self) -> None:
        for conns in self._idle.values():
            for _, upstream in conns:
                upstream.close()
        self._idle.clear()


async def dial(
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
) -> Upstream:
    """Resolve once, here, and dial exactly the addresses resolved (no rebinding window).

    Addresses are tried in the resolver's order; link-local, loopback and metadata
    addresses are skipped unless the allow list named the host as an address."""
    loop = asyncio.get_running_loop()
    if is_address(host):
        candidates = [host.strip("[]")]
    else:
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise Denied(502, f"cannot resolve {host}: {exc.strerror or exc}") from None
        candidates = []
        for info in infos:
            address = str(info[4][0])
            if address in candidates:
                continue
            if any(ipaddress.ip_address(address) in net for net in NEVER_DIAL):
                continue
            candidates.append(address)
        if not candidates:
            raise Denied(403, f"{host} resolves only to link-local, loopback or metadata addresses")
    failures = []
    for address in candidates:
        try:
            if tls is not None:
                streams = await asyncio.wait_for(
                    asyncio.open_connection(
                        address, port, ssl=tls, server_hostname=server_hostname
                    ),
                    CONNECT_TIMEOUT_S,
                )
                return Upstream(address, streams=streams)
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await asyncio.wait_for(loop.sock_connect(sock, (address, port)), CONNECT_TIMEOUT_S)
            except BaseException:
                sock.close()
                raise
            return Upstream(address, sock=sock)
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            failures.append(f"{address}: {getattr(exc, 'strerror', None) or type(exc).__name__}")
    raise Denied(502, f"cannot connect to {host}:{port} ({'; '.join(failures)})")
