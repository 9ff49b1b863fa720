"""The egress proxy: the step's only way to the outside, and only to read.

Every request is parsed by a strict HTTP/1.1 parser (`sandbox.guard.egress.http1`:
h11's grammar and rules), judged, and, when allowed, rebuilt: the real host gets the parsed method,
an origin-form target, the proxy's own Host and framing headers and the
client's end-to-end headers, never the bytes the step sent. GET and HEAD
without a body to an allow-listed host pass; any other method, or a host not on
the list, gets a 403 whose body is the stub reply. Anything the parser finds
ambiguous (bare CR or LF, obs-fold, duplicate or conflicting Content-Length,
Transfer-Encoding on a read, a target with userinfo or naming another host, a
Host header that disagrees with the target, an oversized head) is refused with
400, 431 or 505 and an error text, never the stub sentence. A request that is
not forwarded is one action-log line (method, URL, body size and hash, never
the body). A forwarded one gets its `start` line (with the forwarded head,
credentials masked, and the SHA-256 of its exact bytes) on disk before its
first byte leaves (on plain TCP the action log's writer thread sends the head
itself the moment that line is synced; a log that cannot be written gets the
step a 502 and sends nothing), and its `outcome` line once the reply has been
relayed or the exchange failed (that line may wait up to 20 ms to share the
next line's sync: see `actionlog`); with the action log full it is refused,
never forwarded unlogged. The proxy that an MCP server's relay reaches runs this same code with
that server's own allow list, and every line it writes names the server
(`detail.mcp_server`, from `label`).

HTTPS: a CONNECT to an allow-listed TLS port is inspected by default: the proxy
terminates TLS with this run's CA (`sandbox.guard.egress.tls`) and judges each request
inside the same way, so a POST inside HTTPS is stubbed too. An entry marked
`inspect = false` is a blind tunnel instead, recorded as "method not seen".
What cannot be inspected (a protocol upgrade, HTTP/2, CONNECT to a port not on
the list) is refused. Names are resolved here, for allowed requests only, and
the proxy dials the address it resolved; link-local, loopback and metadata
addresses are never dialled unless the allow list names them as addresses.
Entries marked `model` pass with any method (model calls are allowed) and are
recorded as model calls.

Replies are framed by the proxy: the upstream reply head is parsed (by h11, or
for a read's small reply by `http1.parse_reply` with h11's grammar) and rebuilt
(hop-by-hop headers dropped, Content-Length or chunked set from the parsed
framing, `Connection: close` whenever the proxy will close), so a client
that reuses its connection to the proxy can trust where each reply ends. The
client's connection to the proxy is kept alive between requests (each one judged
and logged on its own; a pipelined request is judged like any other; a denial
closes it).

Keep-alive upstream: each proxy (one run's guard, or one MCP server's proxy of
that run; never shared between runs or between those) keeps a few idle plain-TCP
connections per host:port it dialled (`_Pool`). One is reused only when its last
exchange ended exactly where the reply's framing said (a Content-Length body
read in full, a chunked body to its last chunk, no body for HEAD, 204, 304),
the host spoke HTTP/1.1 without `Connection: close`, no byte arrived past the
reply, and, just before the next request goes out, a poll of the socket shows
neither EOF nor stray bytes. A request is never sent twice: once its first
byte was written to a reused connection, a failure is that request's error
(502 before any reply, or the client's connection ends), as on a new one.
TLS connections to hosts (inside an inspected tunnel) are one per request
(`Connection: close`): the TLS layer may hold bytes a poll cannot see.

A Content-Length or close-delimited body of a plain HTTP reply moves with
`splice(2)`, past Python. Limits: a head is at most 64 KiB and 100 lines (431
past that); a denied request's body is hashed up to 16 MiB; an upstream that
fails after a request was forwarded ends the client's connection (or gets a 502
if no reply had started).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import re
import select
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import h11

from sandbox.contracts.config import Egress, EgressEntry
from sandbox.contracts.guardconfig import GuardConfig
from sandbox.guard.actionlog import ActionLog, LogFull, Started
from sandbox.guard.egress import http1, splice
from sandbox.guard.egress.aliases import HostAliases
from sandbox.guard.egress.http1 import Refused
from sandbox.policy import stub_reply

if TYPE_CHECKING:
    from sandbox.guard.egress.tls import RunCA

MAX_HASHED_BODY_BYTES = 16 * 1024 * 1024
CHUNK = 256 * 1024
SMALL_READ = 64 * 1024  # a reply head's read (a head is at most 64 KiB too)
SPLICE_MIN_BYTES = 64 * 1024  # a smaller rest of a body is cheaper to copy than to splice
CONNECT_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0  # a kept-alive client connection with no request in it
READ_TIMEOUT_S = 30.0  # a request head or body that stops arriving
REPLY_TIMEOUT_S = 300.0  # the upstream's reply head, and each read of its body
LINGER_S, LINGER_IDLE_S, LINGER_BYTES = 2.0, 0.2, 1024 * 1024  # after a denial
READ_METHODS = frozenset({b"GET", b"HEAD"})
POOL_IDLE_PER_HOST = 4  # idle upstream connections kept per host:port
POOL_IDLE_TOTAL = 32  # and per proxy
POOL_IDLE_S = 15.0  # an idle upstream connection older than this is closed, not reused
ESTABLISHED = b"HTTP/1.1 200 Connection Established\r\n\r\n"
# Header values never written to the log (the step's credentials for real hosts).
_SECRET_HEADER = re.compile(
    rb"auth|cookie|token|secret|pass(word|wd)?|api[_-]?key|credential|signature", re.IGNORECASE
)
_NEVER_DIAL = [
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
_REASON_PHRASES = {
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    501: "Not Implemented",
    502: "Bad Gateway",
    505: "HTTP Version Not Supported",
}


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def match(egress: Egress, host: str, port: int, *, tunnel: bool) -> EgressEntry | None:
    """The allow-list entry that admits host:port, if any (wildcards match subdomains only).

    `tunnel` is a CONNECT: it needs port 443 or an entry whose explicit port is marked
    `tls`; plain HTTP needs port 80 or an entry's explicit non-TLS port."""
    host = host.lower().rstrip(".")
    for entry in egress.allow:
        pattern = entry.host.strip("[]")
        if pattern.startswith("*."):
            ok = host.endswith(pattern[1:]) and host != pattern[2:]
        else:
            ok = host == pattern
        if not ok:
            continue
        if entry.port is None:
            if port == (443 if tunnel else 80):
                return entry
        elif entry.port == port and entry.tls == tunnel:
            return entry
    return None


class Denied(Exception):
    """A request that is not forwarded. `stub`: a would-be effect, answered with the stub
    reply; otherwise a refusal, answered with an error. `unlogged`: the action log is
    full and has counted it already, so no line is tried."""

    def __init__(
        self, status: int, reason: str, *, stub: bool = False, unlogged: bool = False
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.stub = stub
        self.unlogged = unlogged


@dataclass
class _Seen:
    """What the log says a request was."""

    method: str = ""
    url: str = ""
    host: str = ""
    tls: str = ""  # "inspected" | "method not seen" | "" (plain HTTP)
    connection: int = 0  # which of the step's connections to this proxy carried it
    forwarded: bool = False  # its start line is written and its bytes went out
    aliases: dict[str, Any] = field(default_factory=dict)  # `sandbox.guard.egress.aliases`
    via: str = "proxy"  # how the step reached the guard: "proxy" | "direct" (redirected)
    destination: str = ""  # a redirected connection's original address:port


@dataclass(frozen=True)
class Direct:
    """A connection the firewall redirected to the guard (`sandbox.guard.egress.transparent`):
    the name it was for (the one the guard's DNS handed out for `address`, else the
    address itself) and its original port. A request on it names no host in its target:
    its Host header must name exactly `name` and `port`."""

    name: str
    port: int
    address: str

    def target(self, raw: bytes) -> http1.Target:
        text = raw.decode("ascii")
        if not text.startswith("/") or "#" in text:
            raise Refused(400, "a request sent straight to a host needs a path target (/...)")
        return http1.Target(self.name, self.port, text)


class _Client:
    """The step's end of one connection, with the bytes received but not yet parsed."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        self.number = number
        self.reader = reader
        self.writer = writer
        self.buffer = bytearray()
        self.tls = False
        self.replying = False  # a reply head went out: no error reply can follow it
        self.denied = False  # the last answer was a denial: linger before closing
        self.direct: Direct | None = None  # redirected by the firewall, not through the proxy
        # Every write waits until the kernel has all of it: nothing stays queued in
        # Python, so a reply body can always be spliced straight after its head.
        writer.transport.set_write_buffer_limits(high=0)

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def splice_socket(self) -> socket.socket | None:
        """The socket to splice a reply into: plain TCP with nothing queued in Python."""
        if self.tls or not splice.AVAILABLE:
            return None
        if self.writer.transport.get_write_buffer_size() != 0:
            return None
        sock: socket.socket | None = self.writer.get_extra_info("socket")
        return sock


class _Upstream:
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
        # or its last exchange ended cleanly (see `_Pool`).
        self.reusable = True
        self.reused = False  # it came from the pool
        self.overread = False  # bytes arrived past the end of a reply

    def looks_open(self) -> bool:
        """Plain TCP with no EOF and no byte waiting: the host has not closed it and sent
        nothing unasked-for. Polled on the socket itself, just before reuse."""
        if self.sock is None or self.sock.fileno() < 0:
            return False
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN | select.POLLPRI)
        return not poller.poll(0)

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
        a reply that is already there (it often is by the time the loop asks: the log's
        writer sent the request) costs one recv, not a reader added and removed and a
        turn of the loop."""
        if self.sock is not None:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                return self.sock.recv(size)
        async with asyncio.timeout(REPLY_TIMEOUT_S):
            if self.sock is not None:
                return await asyncio.get_running_loop().sock_recv(self.sock, size)
            assert self._streams is not None
            return await self._streams[0].read(size)

    def shutdown_write(self) -> None:
        with contextlib.suppress(OSError):
            if self.sock is not None:
                self.sock.shutdown(socket.SHUT_WR)
            elif self._streams is not None and self._streams[1].can_write_eof():
                self._streams[1].write_eof()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.sock is not None:
                self.sock.close()
            elif self._streams is not None:
                self._streams[1].close()


class _Pool:
    """Idle plain-TCP upstream connections of one proxy, by (host, port): the most
    recently used first; at most POOL_IDLE_PER_HOST per host:port and POOL_IDLE_TOTAL
    in all, none older than POOL_IDLE_S."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[tuple[float, _Upstream]]] = {}
        self.reuses = 0

    def take(self, host: str, port: int) -> _Upstream | None:
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

    def give_back(self, host: str, port: int, upstream: _Upstream) -> None:
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
        if sum(len(c) for c in self._idle.values()) >= POOL_IDLE_TOTAL:
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


@dataclass
class _Incoming:
    """One parsed request and the h11 connection that reads its body; `fields` its
    headers by name, indexed once (every check below looks them up)."""

    conn: h11.Connection | None  # None: a head without framing headers (no body)
    request: h11.Request
    head: bytes
    fields: dict[bytes, bytes] = field(init=False)
    # No Transfer-Encoding and no Content-Length other than 0: the head is the whole
    # request (RFC 9112 6.3), so its body is not read through h11 and the bytes after
    # the head stay in the client's buffer as the next request's.
    bodyless: bool = field(init=False)

    def __post_init__(self) -> None:
        self.fields = http1.fields(self.request)
        self.bodyless = http1.body_length(self.fields) == 0

    @property
    def method(self) -> bytes:
        return self.request.method


@dataclass
class EgressProxy:
    config: GuardConfig
    log: ActionLog
    active_calls: Callable[[], list[str]] = field(default=lambda: [])
    # Connections with a request (or a tunnel) in progress; the guard exits at once on
    # SIGTERM only when this is 0. A kept-alive connection waiting idle is not counted.
    open_connections: int = 0
    # Added to every line's detail: whose proxy this is (an MCP server's, by name).
    label: dict[str, object] = field(default_factory=dict)
    _ca: RunCA | None = field(default=None, repr=False)
    _pool: _Pool = field(default_factory=_Pool, repr=False)
    _connections: int = field(default=0, repr=False)
    _upstream_tls: ssl.SSLContext | None = field(default=None, repr=False)
    _aliases: HostAliases | None = field(default=None, repr=False)

    @property
    def upstream_reuses(self) -> int:
        """How many requests went out on a kept-alive upstream connection."""
        return self._pool.reuses

    def close(self) -> None:
        """Close the idle upstream connections (the proxy is stopping)."""
        self._pool.close()

    # -- one client connection -------------------------------------------------

    async def handle(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direct: Direct | None = None,
        tunnel: tuple[str, int, EgressEntry] | None = None,
    ) -> None:
        """Serve one connection of the step: through the proxy, or `direct` (redirected
        by the firewall; `tunnel`: its TLS, terminated already, to that host)."""
        self._connections += 1
        client = _Client(reader, writer, self._connections)
        client.direct, client.tls = direct, tunnel is not None
        self.open_connections += 1
        try:
            keep = True
            while keep:
                keep = await self._one_request(client, tunnel=tunnel)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError):
            pass
        finally:
            self.open_connections -= 1
            with contextlib.suppress(Exception):
                if client.denied:
                    await _linger(client)
                writer.close()
                await writer.wait_closed()

    async def _one_request(
        self, client: _Client, tunnel: tuple[str, int, EgressEntry] | None
    ) -> bool:
        """Read, judge and answer one request; whether the connection carries another."""
        started = time.perf_counter()
        seen = _Seen(tls="inspected" if tunnel else "", connection=client.number)
        if client.direct is not None:
            direct = client.direct
            seen.via, seen.destination = "direct", f"{direct.address}:{direct.port}"
        incoming: _Incoming | None = None
        try:
            incoming = await self._next_request(client)
            if incoming is None:
                return False
            seen.method = incoming.method.decode("ascii")
            if tunnel is not None:
                return await self._inside_tunnel(client, incoming, tunnel, seen, started)
            if incoming.method == b"CONNECT":
                return await self._connect(client, incoming, seen, started)
            return await self._plain(client, incoming, seen, started)
        except Refused as refused:
            await self._deny(
                client, incoming, seen, Denied(refused.status, refused.reason), started
            )
            return False
        except Denied as denied:
            await self._deny(client, incoming, seen, denied, started)
            return False
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError):
            return False
        except Exception as exc:  # fail closed, and say why
            failure = Denied(502, f"proxy error: {type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                await self._deny(client, incoming, seen, failure, started)
            return False

    async def _fill(self, client: _Client, *, idle: bool) -> bytes:
        """The client's next bytes (b"" at its end). `idle`: between requests, when the
        connection does not count as busy and may wait longer."""
        if idle:
            self.open_connections -= 1
        try:
            timeout = IDLE_TIMEOUT_S if idle else READ_TIMEOUT_S
            async with asyncio.timeout(timeout):
                return await client.reader.read(CHUNK)
        finally:
            if idle:
                self.open_connections += 1

    async def _next_request(self, client: _Client) -> _Incoming | None:
        """The next request's head, checked and parsed; None when the client is done."""
        while True:
            end = http1.head_end(client.buffer)
            if end is not None:
                break
            idle = not client.buffer
            try:
                data = await self._fill(client, idle=idle)
            except TimeoutError:
                if idle:
                    return None
                raise Refused(408, "the request head stopped arriving") from None
            if not data:
                if client.buffer:
                    raise Refused(400, "the connection closed in the middle of a request head")
                return None
            client.buffer += data
        head = bytes(client.buffer[:end])
        conn, request = http1.parse_request(head)  # a refusal leaves the head for the log
        incoming = _Incoming(conn, request, head)
        del client.buffer[:end]  # what follows a body-less head is the next request's
        if client.buffer and conn is not None and not incoming.bodyless:
            # h11 takes b"" for the client's end: a body still on its way is not that
            conn.receive_data(bytes(client.buffer))
            client.buffer.clear()
        return incoming

    async def _body(self, client: _Client, incoming: _Incoming) -> AsyncIterator[bytes]:
        """The request's body as h11 decodes it; what follows it stays in the buffer."""
        conn = incoming.conn
        if incoming.bodyless or conn is None:
            return
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise Refused(400, f"malformed request body: {exc}") from None
            if event is h11.NEED_DATA:
                conn.receive_data(await self._fill(client, idle=False))
            elif isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise Refused(400, "the request body ended early")
        client.buffer += conn.trailing_data[0]

    # -- judging ------------------------------------------------------------------

    async def _plain(
        self, client: _Client, incoming: _Incoming, seen: _Seen, started: float
    ) -> bool:
        request = incoming.request
        seen.url = request.target.decode("ascii")
        direct = client.direct
        target = direct.target(request.target) if direct else http1.absolute_target(request.target)
        seen.url, seen.host = target.url("http"), target.host
        await self._note_aliases(seen)
        http1.check_host(request, incoming.fields, target.host, target.port, 80)
        if b"upgrade" in incoming.fields:
            raise Denied(403, "a protocol upgrade cannot be inspected")
        entry = match(self.config.egress, target.host, target.port, tunnel=False)
        if entry is None:
            reason = f"{target.host}:{target.port} is not on the egress allow list"
            raise Denied(403, reason, stub=True)
        _judge_read(incoming, entry)
        upstream = self._pool.take(target.host, target.port)
        if upstream is None:
            upstream = await self._dial(target.host, target.port)
        return await self._forward(client, incoming, upstream, target, entry, seen, started)

    async def _connect(
        self, client: _Client, incoming: _Incoming, seen: _Seen, started: float
    ) -> bool:
        request = incoming.request
        seen.url = request.target.decode("ascii")
        host, port = http1.connect_target(request.target)
        seen.host = host
        await self._note_aliases(seen)
        http1.check_host(request, incoming.fields, host, port, port)
        if incoming.fields.get(b"content-length") or incoming.fields.get(b"transfer-encoding"):
            raise Refused(400, "a CONNECT carries no body")
        entry = match(self.config.egress, host, port, tunnel=True)
        if entry is None:
            raise Denied(403, f"CONNECT to {host}:{port} is not on the egress allow list")
        async for _ in self._body(client, incoming):
            pass
        if not self.config.egress.inspects(entry):
            await self._blind_tunnel(client, host, port, entry, seen, started)
            return False
        if client.buffer:
            raise Refused(400, "bytes arrived before the tunnel was open")
        context = self._ca_for(host)
        await client.write(ESTABLISHED)
        client.replying = True
        try:
            await client.writer.start_tls(context)
        except (ssl.SSLError, ConnectionError, TimeoutError) as exc:
            seen.tls = "inspected"
            reason = f"the step's TLS handshake with the proxy failed: {exc}"
            await self._record(seen, "refuse", reason, started, status=None)
            return False
        client.tls, client.replying = True, False
        keep = True
        while keep:
            keep = await self._one_request(client, tunnel=(host, port, entry))
        return False

    async def _inside_tunnel(
        self,
        client: _Client,
        incoming: _Incoming,
        tunnel: tuple[str, int, EgressEntry],
        seen: _Seen,
        started: float,
    ) -> bool:
        host, port, entry = tunnel
        request = incoming.request
        seen.host = host
        await self._note_aliases(seen)
        raw = request.target.decode("ascii")
        # Until the target is judged the line shows it as sent, never glued to the host.
        seen.url = http1.Target(host, port, raw).url("https") if raw.startswith("/") else raw
        target = http1.tunnel_target(request.target, host, port)
        seen.url = target.url("https")
        http1.check_host(request, incoming.fields, host, port, 443)
        if b"upgrade" in incoming.fields:
            raise Denied(403, "a protocol upgrade inside TLS cannot be inspected")
        _judge_read(incoming, entry)
        upstream = await self._dial(host, port, tls=self._tls_to_hosts(), server_hostname=host)
        return await self._forward(client, incoming, upstream, target, entry, seen, started)

    # -- forwarding ---------------------------------------------------------------

    async def _forward(
        self,
        client: _Client,
        incoming: _Incoming,
        upstream: _Upstream,
        target: http1.Target,
        entry: EgressEntry,
        seen: _Seen,
        started: float,
    ) -> bool:
        """Send the rebuilt request, then relay the reply; whether the client's connection
        carries another request. `upstream` goes back to the pool (or is closed) either way."""
        given_back = False
        try:
            request = incoming.request
            default_port = 443 if seen.tls else 80
            framing = (b"content-length", b"transfer-encoding") if entry.model else ()
            headers = [
                (b"Host", target.authority(default_port).encode("ascii")),
                *http1.forward_headers(request, keep=framing),
            ]
            if upstream.sock is None:  # TLS to the host: one connection per request
                headers.append((b"Connection", b"close"))
            sent = _Sent(request.method, target.origin.encode("ascii"), headers)
            outgoing, head = _request_head(sent)
            kind = "model call" if entry.model else "read"
            where = " (inspected inside TLS)" if seen.tls else ""
            # Plain TCP: the log's writer sends the head the moment its line is written,
            # before its sync (the upstream works while the disk syncs); the reply is
            # relayed only once `begin` returns, the line on disk.
            early = [0]

            def send_head() -> None:
                seen.forwarded = True  # a sync failing after this: an error, not a refusal
                early[0] = upstream.send_now(head)

            logged = await self._begin(
                seen,
                f"allow-listed {kind}{where}",
                category="model" if entry.model else "egress",
                extra_detail={
                    "resolved": upstream.address,
                    "forwarded_sha256": _sha(head),
                    **({"upstream_reused": True} if upstream.reused else {}),
                },
                extra_arguments={"forwarded_head": _shown_head(head)},
                then=send_head if upstream.sock is not None else None,
            )
            seen.forwarded = True
            outcome: dict[str, Any] = {}
            try:
                if logged.then_error is not None:
                    raise logged.then_error
                await upstream.send(head[early[0] :])
                if entry.model and b"100-continue" in incoming.fields.get(b"expect", b""):
                    await client.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                if outgoing is not None:  # h11 frames the body (none for a read)
                    async for chunk in self._body(client, incoming):
                        await upstream.send(outgoing.send(h11.Data(data=chunk)) or b"")
                    await upstream.send(outgoing.send(h11.EndOfMessage()) or b"")
                keep = await self._relay_reply(client, upstream, outgoing, sent, request, outcome)
                # free for the next request at once, while this one's outcome is written
                given_back = True
                self._pool.give_back(target.host, target.port, upstream)
                return keep
            except BaseException as exc:  # a cancelled exchange (the guard stopping) too
                outcome["error"] = _failure(exc)
                upstream.reusable = False
                raise
            finally:
                # the reply has gone out: the next request on this connection need not
                # wait for this line's sync (it is on disk before that request's start)
                ok = "error" not in outcome and not outcome.get("reply_cut")
                self.log.outcome_queued(logged, ok=ok, detail=outcome)
        finally:
            if not given_back:
                self._pool.give_back(target.host, target.port, upstream)

    async def _relay_reply(
        self,
        client: _Client,
        upstream: _Upstream,
        outgoing: h11.Connection | None,
        sent: _Sent,
        request: h11.Request,
        outcome: dict[str, Any],
    ) -> bool:
        """Relay the reply; `outcome` gets its status (and `reply_cut` when the upstream
        ended the body early). Whether the client's connection carries another request.

        `outgoing` None (a request without a body, written by the proxy): the reply
        head is parsed here with h11's grammar (`http1.parse_reply`) when its first read
        holds all of it; a reply with no body, or with a Content-Length body of at most
        SPLICE_MIN_BYTES past what came with the head (a small reply, read whole
        here), is relayed from there in one write. Any other reply (a head split
        across reads, a large body, chunked, to the close, informational, cut short,
        or one the grammar does not take) goes to an h11 connection that is told the
        request and given every byte read so far, and is relayed by h11 as before."""
        raw = b""
        parsed: tuple[h11.Response, bytes] | None = None
        if outgoing is None:
            # at most a head and a small body: a buffer below malloc's mmap threshold
            raw = await upstream.recv(SMALL_READ)
            parsed = http1.parse_reply(raw)
        if parsed is not None:
            response, rest = parsed
            found = http1.fields(response)
            framing, length = _framing(request.method, response.status_code, found)
            # A small body's rest (its head and body may come in two sends) is read
            # here; a large one is relayed by h11 and splice, as before.
            while framing == "length" and len(rest) < length <= len(rest) + SPLICE_MIN_BYTES:
                more = await upstream.recv(SMALL_READ)
                if not more:
                    break  # cut short: h11's relay below says so
                raw += more
                rest += more
            if not (framing == "none" or (framing == "length" and len(rest) >= length)):
                parsed = None  # not all here, or not counted: h11 gets every byte read
        if parsed is None:
            if outgoing is None:
                outgoing = _h11_outgoing(sent)
                outgoing.receive_data(raw)  # b"": the host closed, which h11 then says
            response, rest = await _reply_head(upstream, outgoing), b""
            found = http1.fields(response)
            framing, length = _framing(request.method, response.status_code, found)
        status = response.status_code
        outcome["status"] = status
        tokens = http1.connection_tokens(response)
        client_11 = request.http_version == b"1.1"
        keep = http1.wants_keep_alive(request) and framing != "close"
        headers = http1.forward_headers(response, tokens=tokens)
        if framing == "length":
            headers.append((b"Content-Length", b"%d" % length))
        elif framing == "chunked" and client_11:
            headers.append((b"Transfer-Encoding", b"chunked"))
        elif framing == "chunked":
            keep = False  # an HTTP/1.0 client: the body runs to the close
        elif framing == "none" and status != 204:
            declared = found.get(b"content-length")
            if declared is not None:
                headers.append((b"Content-Length", declared))
        if not keep:
            headers.append((b"Connection", b"close"))
        head = b"HTTP/1.1 %d %s\r\n" % (status, response.reason)
        head += b"".join(name + b": " + value + b"\r\n" for name, value in headers) + b"\r\n"
        client.replying = True
        complete = True
        after = b""  # what came after the reply (a reply relayed without h11)
        if outgoing is None:
            body, after = rest[:length], rest[length:]
            await client.write(head + body)
        elif framing == "none":
            await client.write(head)
        elif framing == "chunked":
            await _relay_chunked(client, upstream, outgoing, head, chunked=client_11)
        else:
            complete = await _relay_counted(
                client, upstream, outgoing, head, length if framing == "length" else None
            )
            if not complete:
                outcome["reply_cut"] = True
            keep = keep and complete
        if outgoing is not None:
            after = outgoing.trailing_data[0]
        client.replying = False
        # The upstream connection may carry the next request only when this reply ended
        # exactly where its framing said and nothing came after it.
        upstream.reusable = (
            complete
            and framing != "close"
            and response.http_version == b"1.1"
            and b"close" not in tokens
            and not upstream.overread
            and not after
        )
        return keep

    async def _blind_tunnel(
        self, client: _Client, host: str, port: int, entry: EgressEntry, seen: _Seen, started: float
    ) -> None:
        """An opted-out host: the tunnel is relayed unopened and the line says so."""
        upstream = await self._dial(host, port)
        seen.tls = "method not seen"
        try:
            logged = await self._begin(
                seen,
                "allow-listed CONNECT to a host with inspect = false; "
                "the method inside TLS was not seen",
                category="model" if entry.model else "egress",
                extra_detail={"resolved": upstream.address},
            )
            seen.forwarded = True
            outcome: dict[str, Any] = {}
            try:
                if client.direct is None:  # a redirected connection asked for no tunnel
                    await client.write(ESTABLISHED)
                client.replying = True
                early, client.buffer = bytes(client.buffer), bytearray()
                await upstream.send(early)
                await asyncio.gather(_pump_up(client, upstream), _pump_down(upstream, client))
            except BaseException as exc:  # a cancelled tunnel (the guard stopping) too
                outcome["error"] = _failure(exc)
                raise
            finally:
                await self.log.outcome(logged, ok="error" not in outcome, detail=outcome)
        finally:
            upstream.close()

    async def _dial(
        self,
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> _Upstream:
        """Resolve once, here, and dial exactly the addresses resolved (no rebinding window).

        Addresses are tried in the resolver's order; link-local, loopback and metadata
        addresses are skipped unless the allow list named the host as an address. With
        the action log full nothing is dialled: the request is refused."""
        try:
            self.log.check_room()
        except LogFull as full:
            raise Denied(403, str(full)) from None
        loop = asyncio.get_running_loop()
        if _is_address(host):
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
                if any(ipaddress.ip_address(address) in net for net in _NEVER_DIAL):
                    continue
                candidates.append(address)
            if not candidates:
                raise Denied(
                    403, f"{host} resolves only to link-local, loopback or metadata addresses"
                )
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
                    return _Upstream(address, streams=streams)
                family = socket.AF_INET6 if ":" in address else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
                try:
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await asyncio.wait_for(
                        loop.sock_connect(sock, (address, port)), CONNECT_TIMEOUT_S
                    )
                except BaseException:
                    sock.close()
                    raise
                return _Upstream(address, sock=sock)
            except (OSError, TimeoutError, ssl.SSLError) as exc:
                failures.append(
                    f"{address}: {getattr(exc, 'strerror', None) or type(exc).__name__}"
                )
        raise Denied(502, f"cannot connect to {host}:{port} ({'; '.join(failures)})")

    def _ca_for(self, host: str) -> ssl.SSLContext:
        """The TLS context the proxy shows the step for `host` (the run's CA, loaded on the
        first inspected CONNECT so runs without HTTPS never pay for it)."""
        if self._ca is None:
            if not (self.config.egress_ca_pem and self.config.egress_ca_key_pem):
                raise Denied(403, "TLS inspection is on for this host but the run has no CA")
            from sandbox.guard.egress.tls import RunCA  # cryptography: on demand

            self._ca = RunCA.from_pem(self.config.egress_ca_pem, self.config.egress_ca_key_pem)
        return self._ca.context_for(host)

    def _tls_to_hosts(self) -> ssl.SSLContext:
        if self._upstream_tls is None:
            from sandbox.guard.egress.tls import upstream_context

            self._upstream_tls = upstream_context(self.config.egress_trust_pem)
        return self._upstream_tls

    # -- denial and records -------------------------------------------------------

    async def _body_facts(self, client: _Client, incoming: _Incoming | None) -> dict[str, Any]:
        """Size and hash of a denied request's body (read, never forwarded, never logged)."""
        if incoming is None:
            return {}
        if b"100-continue" in incoming.fields.get(b"expect", b""):
            return {"body_bytes": None, "body_note": "not sent: the client waited for 100"}
        digest = hashlib.sha256()
        size = 0
        try:
            async for chunk in self._body(client, incoming):
                digest.update(chunk)
                size += len(chunk)
                if size > MAX_HASHED_BODY_BYTES:
                    return {"body_bytes": size, "body_sha256": None, "body_truncated": True}
        except (Refused, TimeoutError, ConnectionError):
            return {"body_bytes": size, "body_sha256": None, "body_truncated": True}
        return {"body_bytes": size, "body_sha256": digest.hexdigest()}

    async def _deny(
        self,
        client: _Client,
        incoming: _Incoming | None,
        seen: _Seen,
        denied: Denied,
        started: float,
    ) -> None:
        """Record the denial, then answer it (stub reply or error) and close."""
        if seen.forwarded:
            # The request went out: its start line says so and its outcome line (written
            # where it was forwarded) says how it failed; that is not a second decision.
            # The step gets an error if no reply has started.
            if not client.replying:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await client.write(_error_reply(denied, seen))
            return
        body = await self._body_facts(client, incoming) if denied.stub else {}
        if incoming is None and client.buffer:
            body["head_bytes"] = len(client.buffer)
            body["head_sha256"] = _sha(bytes(client.buffer))
            first = bytes(client.buffer[:200]).split(b"\n", 1)[0]
            body["first_line"] = first.decode("latin-1")
        decision = "stub" if denied.stub else "refuse"
        if not denied.unlogged:
            await self._record(
                seen, decision, denied.reason, started, status=denied.status, body=body
            )
        if client.replying:
            return  # a reply is under way: ending the connection is the only honest answer
        with contextlib.suppress(ConnectionError, RuntimeError):
            await client.write(_error_reply(denied, seen))
        client.denied = True

    async def _record(
        self,
        seen: _Seen,
        decision: str,
        reason: str,
        started: float,
        *,
        status: int | None,
        category: str = "egress",
        body: dict[str, Any] | None = None,
    ) -> None:
        """The one line of a request that was not forwarded (a denial)."""
        arguments, detail = self._facts(seen, status=status, body=body)
        await self.log.write(
            session="egress",
            tool="http",
            decision=decision,
            reason=reason,
            category=category,
            arguments=arguments,
            duration_ms=(time.perf_counter() - started) * 1000,
            detail=detail,
        )

    async def _begin(
        self,
        seen: _Seen,
        reason: str,
        *,
        category: str,
        extra_detail: dict[str, Any],
        extra_arguments: dict[str, Any] | None = None,
        then: Callable[[], object] | None = None,
    ) -> Started:
        """The start line of a request about to be forwarded: written before its first
        byte leaves (`then`: that first byte, sent by the log's writer), on disk before
        this returns. With the log full, or a log that cannot be written, the request
        is refused instead (Denied): nothing was sent. A sync that failed after the
        head went fails the request (Denied, as sent but failed): its reply is never
        relayed, the connection is not reused, and the failed log takes no line more."""
        arguments, detail = self._facts(
            seen, status=None, extra_detail=extra_detail, extra_arguments=extra_arguments
        )
        try:
            return await self.log.begin(
                session="egress",
                tool="http",
                decision="allow",
                reason=reason,
                category=category,
                arguments=arguments,
                detail=detail,
                then=then,
            )
        except LogFull as full:
            raise Denied(403, str(full), unlogged=True) from None
        except OSError as exc:  # the line is not on disk: nothing more may happen
            reason = f"the action log could not be written ({exc.strerror or exc})"
            raise Denied(502, reason, unlogged=True) from None

    async def _note_aliases(self, seen: _Seen) -> None:
        """The allow-listed names of an address, or the addresses of a name, for the line."""
        if self._aliases is None:
            self._aliases = HostAliases(self.config.egress)
        seen.aliases = await self._aliases.detail(seen.host)

    def _facts(
        self,
        seen: _Seen,
        *,
        status: int | None,
        body: dict[str, Any] | None = None,
        extra_detail: dict[str, Any] | None = None,
        extra_arguments: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A line's arguments (method, URL, body facts, forwarded head) and detail (whose
        proxy, host, the step's connection it came on, status, TLS, calls in flight):
        every egress line is made here."""
        arguments: dict[str, Any] = {"method": seen.method, "url": seen.url}
        arguments.update(body or {})
        arguments.update(extra_arguments or {})
        detail: dict[str, Any] = {**self.label, "host": seen.host, "connection": seen.connection}
        detail.update(seen.aliases)
        detail["via"] = seen.via
        if seen.destination:
            detail["destination"] = seen.destination
        if status is not None:
            detail["status"] = status
        if seen.tls:
            detail["tls"] = seen.tls
        detail.update(extra_detail or {})
        active = self.active_calls()
        if active:
            detail["active_tool_calls"] = active
        return arguments, detail


def _judge_read(incoming: _Incoming, entry: EgressEntry) -> None:
    """Raise unless an allow-listed request may pass: a model endpoint takes any method;
    anything else passes only as GET or HEAD without a body."""
    if entry.model:
        return
    method = incoming.method.decode("ascii")
    if incoming.method not in READ_METHODS:
        raise Denied(403, f"HTTP {method} can have effects; only GET and HEAD pass", stub=True)
    if b"transfer-encoding" in incoming.fields:
        raise Refused(400, "Transfer-Encoding on a read is ambiguous; it is not forwarded")
    if http1.body_length(incoming.fields):
        raise Denied(
            403, "a read (GET or HEAD) carries no body; one that does is not forwarded", stub=True
        )


@dataclass(frozen=True)
class _Sent:
    """The request as forwarded: method, origin-form target and headers (Host first)."""

    method: bytes
    origin: bytes
    headers: list[tuple[bytes, bytes]]


def _request_head(sent: _Sent) -> tuple[h11.Connection | None, bytes]:
    """The forwarded request's head, and the h11 connection that writes its body and
    reads its reply (None: there is no body, and the reply is read without h11 while
    it can be; see `_relay_reply`).

    A request without framing headers (every read) is written here, byte for byte as
    h11 writes it (request line, Host first, then the rest in order:
    tests/test_http1.py pins that). Nothing in it needs h11's validation again: the
    method, the target's path and every client header came out of h11's grammar
    (`http1.parse_request`), and Host and Connection are the proxy's own, built from
    the judged target. A request with a body (a model call's Content-Length or
    chunked framing) goes through h11 whole, so that h11 frames the body it writes."""
    named = {name.lower() for name, _ in sent.headers}
    if b"content-length" in named or b"transfer-encoding" in named:
        outgoing = _new_outgoing()
        head = outgoing.send(
            h11.Request(method=sent.method, target=sent.origin, headers=sent.headers)
        )
        assert head is not None
        return outgoing, head
    return None, http1.request_head(sent.method, sent.origin, sent.headers)


def _new_outgoing() -> h11.Connection:
    return h11.Connection(h11.CLIENT, max_incomplete_event_size=http1.MAX_HEAD_BYTES)


def _h11_outgoing(sent: _Sent) -> h11.Connection:
    """An h11 connection told about a body-less request that went out already (what
    frames its reply: method, target, Host, Connection), ready to read the reply."""
    outgoing = _new_outgoing()
    framing = [(n, v) for n, v in sent.headers if n.lower() in (b"host", b"connection")]
    outgoing.send(h11.Request(method=sent.method, target=sent.origin, headers=framing))
    outgoing.send(h11.EndOfMessage())
    return outgoing


def _framing(method: bytes, status: int, found: dict[bytes, bytes]) -> tuple[str, int]:
    """How a reply's body is framed ("none", "chunked", "length", "close"), and its
    length when counted. `found`: the reply's `fields`."""
    if method == b"HEAD" or status in (204, 304):
        return "none", 0
    if b"transfer-encoding" in found:
        return "chunked", 0
    if (declared := found.get(b"content-length")) is not None:
        return "length", int(declared)
    return "close", 0


async def _reply_head(upstream: _Upstream, outgoing: h11.Connection) -> h11.Response:
    """The upstream's final reply head, as h11 parses it (informational replies skipped)."""
    while True:
        try:
            event = outgoing.next_event()
        except h11.RemoteProtocolError as exc:
            raise Denied(502, f"the host sent a malformed reply: {exc}") from None
        if event is h11.NEED_DATA:
            outgoing.receive_data(await upstream.recv())
        elif isinstance(event, h11.Response):
            return event
        elif isinstance(event, h11.InformationalResponse):
            continue
        else:
            raise Denied(502, "the host closed the connection without a reply")


async def _relay_counted(
    client: _Client, upstream: _Upstream, outgoing: h11.Connection, head: bytes, length: int | None
) -> bool:
    """The reply head, then a body of `length` bytes (None: up to the upstream's close);
    True when all of it arrived. What h11 already holds goes out with the head; the rest
    is spliced when both ends are plain TCP."""
    sent = 0
    pending = bytearray(head)
    while length is None or sent < length:
        try:
            event = outgoing.next_event()
        except h11.RemoteProtocolError:
            break
        if not isinstance(event, h11.Data):
            break
        pending += event.data
        sent += len(event.data)
    await client.write(bytes(pending))
    remaining = None if length is None else length - sent
    if remaining == 0:
        return True
    target = client.splice_socket()
    small = remaining is not None and remaining <= SPLICE_MIN_BYTES
    if upstream.sock is not None and target is not None and not small:
        moved = await splice.relay(upstream.sock, target, remaining)
        return remaining is not None and moved == remaining
    while remaining is None or remaining > 0:
        data = await upstream.recv()
        if not data:
            return remaining is None
        if remaining is not None:
            if len(data) > remaining:
                upstream.overread = True
            data = data[:remaining]
            remaining -= len(data)
        await client.write(data)
    return True


async def _relay_chunked(
    client: _Client, upstream: _Upstream, outgoing: h11.Connection, head: bytes, *, chunked: bool
) -> None:
    """The reply head, then a chunked body, decoded by h11 and framed again by the proxy
    (trailers dropped); `chunked` False writes it plain, for an HTTP/1.0 client that
    reads to the close."""
    await client.write(head)
    while True:
        try:
            event = outgoing.next_event()
        except h11.RemoteProtocolError as exc:
            raise ConnectionError(f"malformed chunked reply: {exc}") from None
        if event is h11.NEED_DATA:
            outgoing.receive_data(await upstream.recv())
        elif isinstance(event, h11.Data):
            if event.data:
                data = bytes(event.data)
                await client.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        elif isinstance(event, h11.EndOfMessage):
            if chunked:
                await client.write(b"0\r\n\r\n")
            return
        else:
            raise ConnectionError("the chunked reply ended early")


async def _pump_up(client: _Client, upstream: _Upstream) -> None:
    try:
        while data := await client.reader.read(CHUNK):
            await upstream.send(data)
    except (ConnectionError, OSError):
        pass
    finally:
        upstream.shutdown_write()


async def _pump_down(upstream: _Upstream, client: _Client) -> None:
    target = client.splice_socket()
    try:
        if upstream.sock is not None and target is not None:
            await splice.relay(upstream.sock, target)
        else:
            while data := await upstream.recv():
                await client.write(data)
    except (ConnectionError, OSError, TimeoutError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if client.writer.can_write_eof():
                client.writer.write_eof()


async def _linger(client: _Client) -> None:
    """Read what the client still sends (for a moment) before closing: closing with
    unread bytes resets the connection, and a reset can destroy the denial the client
    has not read yet (the lingering close of HTTP servers)."""
    if not client.tls and client.writer.can_write_eof():
        client.writer.write_eof()  # a client that reads to the end closes at once
    deadline = time.monotonic() + LINGER_S
    drained = 0
    while drained < LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
        try:
            data = await asyncio.wait_for(client.reader.read(CHUNK), min(left, LINGER_IDLE_S))
        except (TimeoutError, ConnectionError, ssl.SSLError):
            return
        if not data:
            return
        drained += len(data)


def _error_reply(denied: Denied, seen: _Seen) -> bytes:
    """A denial as HTTP: the stub reply for a stub, an error text for anything else
    (never "continue as if it succeeded"); the proxy closes after it."""
    label = f"HTTP {seen.method}" if seen.method else "HTTP request"
    if denied.stub:
        text, mark = stub_reply(label, denied.reason), b"stubbed"
    elif seen.forwarded:
        text, mark = f"TEST MODE: {label} was sent but failed ({denied.reason}).", b"error"
    else:
        text, mark = (
            f"TEST MODE: {label} was refused ({denied.reason}); nothing was sent.",
            b"refused",
        )
    payload = (text + "\n").encode()
    phrase = _REASON_PHRASES.get(denied.status, "Error").encode()
    return (
        b"HTTP/1.1 %d %s\r\n" % (denied.status, phrase)
        + b"Content-Type: text/plain; charset=utf-8\r\n"
        + b"Content-Length: %d\r\n" % len(payload)
        + b"X-Agentworks-Test-Mode: "
        + mark
        + b"\r\nConnection: close\r\n\r\n"
        + payload
    )


def _failure(exc: BaseException) -> str:
    """How a forwarded exchange failed, for its outcome line."""
    if isinstance(exc, Denied | Refused):
        return exc.reason
    return f"{type(exc).__name__}: {exc}"[:300]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _shown_head(head: bytes) -> list[str]:
    """The forwarded head as log lines, credentials masked (the hash covers the bytes)."""
    lines = head.split(b"\r\n")[:-2]
    shown = [lines[0].decode("latin-1")]
    for line in lines[1:]:
        name, _, value = line.partition(b": ")
        masked = b"[redacted]" if _SECRET_HEADER.search(name) else value
        shown.append((name + b": " + masked).decode("latin-1"))
    return shown


async def listen(proxy: EgressProxy, listener: socket.socket) -> asyncio.Server:
    """Serve `proxy` on a socket that already listens: the step's port on loopback, or
    the unix socket an MCP server's relay reaches."""
    limit = http1.MAX_HEAD_BYTES
    if listener.family == socket.AF_UNIX:
        return await asyncio.start_unix_server(proxy.handle, sock=listener, limit=limit)
    return await asyncio.start_server(proxy.handle, sock=listener, limit=limit)


@contextlib.asynccontextmanager
async def running(
    config: GuardConfig,
    log: ActionLog,
    active_calls: Callable[[], list[str]] | None = None,
    listener: socket.socket | None = None,
) -> AsyncIterator[EgressProxy]:
    """Serve the proxy on loopback for the guard's lifetime (on `listener` when given)."""
    proxy = EgressProxy(config, log, active_calls or (lambda: []))
    if listener is not None:
        server = await listen(proxy, listener)
    else:
        server = await asyncio.start_server(
            proxy.handle, "127.0.0.1", config.egress_port, limit=http1.MAX_HEAD_BYTES
        )
    for sock in server.sockets:  # before the first connection is accepted
        splice.unpaced(sock)
    try:
        yield proxy
    finally:
        server.close()
        proxy.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)
