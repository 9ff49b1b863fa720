"""The egress proxy: the step's only way to the outside, and only to read.

Plain HTTP GET and HEAD to an allow-listed host pass and stream; any other
method, or any host not on the list, gets a 403 whose body is the stub reply
and a line in the action log (method, URL, body size and hash, never the
body). HTTPS is a CONNECT to an allow-listed host:port, tunnelled and recorded
as such: the method inside TLS is not seen. What cannot be inspected (a
WebSocket upgrade, HTTP/2 prior knowledge, CONNECT to a port not on the list)
is a recorded denial, never a silent tunnel. Names are resolved here, for
allowed requests only, and the proxy dials the address it resolved; link-local,
loopback and metadata addresses are never dialled unless the allow list names
them as addresses. Entries marked `model` pass with any method (model calls
are allowed by the spec) and are recorded as model calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from sandbox.config import Egress, EgressEntry
from sandbox.guard import splice
from sandbox.guard.actionlog import ActionLog, LogFull, Started
from sandbox.guard.config import GuardConfig
from sandbox.policy import stub_reply

if TYPE_CHECKING:
    from sandbox.guard.tls import RunCA

MAX_HEAD_BYTES = 64 * 1024
MAX_HASHED_BODY_BYTES = 16 * 1024 * 1024
CHUNK = 256 * 1024
CONNECT_TIMEOUT_S = 10.0
READ_METHODS = frozenset({"GET", "HEAD"})
HOP_BY_HOP = frozenset(
    {
        "proxy-connection",
        "proxy-authorization",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "transfer-encoding",
    }
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


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    entry: EgressEntry | None


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
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    head_bytes: int

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


async def _read_head(reader: asyncio.StreamReader) -> _Request | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    except asyncio.LimitOverrunError:
        raise Denied(431, "request head too large") from None
    text = raw.decode("latin-1")
    if text.startswith("PRI * HTTP/2.0"):
        raise Denied(505, "HTTP/2 prior knowledge cannot be inspected")
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise Denied(400, "malformed request line")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise Denied(400, "malformed header")
        headers.append((name, value.strip()))
    return _Request(parts[0].upper(), parts[1], parts[2], headers, len(raw))


@dataclass
class EgressProxy:
    config: GuardConfig
    log: ActionLog
    active_calls: Callable[[], list[str]] = field(default=lambda: [])
    ca: RunCA | None = None  # set when egress.inspect_tls: CONNECTs are opened and inspected
    upstream_tls: ssl.SSLContext | None = None
    open_connections: int = 0  # the guard exits at once on SIGTERM only when this is 0
    # Added to every line's detail: whose proxy this is (an MCP server's, by name).
    label: dict[str, object] = field(default_factory=dict)

    # -- one client connection -------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        started = time.perf_counter()
        request: _Request | None = None
        self.open_connections += 1
        try:
            request = await _read_head(reader)
            if request is None:
                return
            if request.method == "CONNECT":
                await self._connect(request, reader, writer, started)
            else:
                await self._plain(request, reader, writer, started)
        except Denied as denied:
            await self._deny(writer, request, denied, started, body=None)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except Exception as exc:  # fail closed, and say why in the log
            failure = Denied(502, f"proxy error: {type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                await self._deny(writer, request, failure, started, body=None)
        finally:
            self.open_connections -= 1
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _plain(
        self,
        request: _Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        started: float,
    ) -> None:
        url = urlsplit(request.target)
        if url.scheme != "http" or not url.hostname:
            raise Denied(400, "a proxy request needs an absolute http:// URL")
        upgrade = (request.header("upgrade") or "").lower()
        if upgrade:
            body = await self._body_facts(request, reader)
            refusal = Denied(403, f"protocol upgrade to {upgrade!r} cannot be inspected")
            await self._deny(writer, request, refusal, started, body=body)
            return
        port = url.port or 80
        entry = match(self.config.egress, url.hostname, port, tunnel=False)
        if entry is None:
            body = await self._body_facts(request, reader)
            reason = f"{url.hostname}:{port} is not on the egress allow list"
            await self._deny(writer, request, Denied(403, reason), started, body=body)
            return
        why_not = _not_a_read(request, entry)
        if why_not is not None:
            body = await self._body_facts(request, reader)
            await self._deny(writer, request, Denied(403, why_not), started, body=body)
            return
        address, upstream_reader, upstream_writer = await self._dial(url.hostname, port)
        path = url.path or "/"
        if url.query:
            path += "?" + url.query
        host_header = url.hostname if url.port is None else f"{url.hostname}:{url.port}"
        kind = "model call" if entry.model else "read"
        logged = self._begin(
            request,
            f"allow-listed {kind}",
            category=("model" if entry.model else "egress"),
            detail={"resolved": address},
            upstream=upstream_writer,
        )
        upstream_writer.write(_origin_head(request, path, host_header))
        await self._relay(
            logged,
            reader,
            writer,
            upstream_reader,
            upstream_writer,
            zero_copy=True,
            forward_client=entry.model,
        )

    async def _connect(
        self,
        request: _Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        started: float,
    ) -> None:
        host, sep, port_text = request.target.rpartition(":")
        if not sep or not port_text.isdigit():
            raise Denied(400, "CONNECT needs host:port")
        host = host.strip("[]")
        port = int(port_text)
        entry = match(self.config.egress, host, port, tunnel=True)
        if entry is None:
            reason = f"CONNECT to {host}:{port} is not on the egress allow list"
            await self._deny(writer, request, Denied(403, reason), started, body=None)
            return
        if self.ca is not None:
            await self._inspect(request, host, port, entry, reader, writer, started)
            return
        address, upstream_reader, upstream_writer = await self._dial(host, port)
        logged = self._begin(
            request,
            "allow-listed CONNECT; the method inside TLS was not seen",
            category="model" if entry.model else "egress",
            detail={"resolved": address, "tls": "method not seen"},
            upstream=upstream_writer,
        )
        writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        await writer.drain()
        await self._relay(logged, reader, writer, upstream_reader, upstream_writer, zero_copy=True)

    async def _inspect(
        self,
        connect: _Request,
        host: str,
        port: int,
        entry: EgressEntry,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        started: float,
    ) -> None:
        """Open the tunnel with this run's CA and judge the request inside like plain HTTP."""
        assert self.ca is not None
        writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        await writer.drain()
        await writer.start_tls(self.ca.context_for(host))
        inner = await _read_head(reader)
        if inner is None:
            return
        authority = host if port == 443 else f"{host}:{port}"
        url = f"https://{authority}{inner.target}"
        shown = _Request(inner.method, url, inner.version, inner.headers, inner.head_bytes)
        if (inner.header("upgrade") or "").strip():
            refusal = Denied(403, "protocol upgrade inside TLS cannot be inspected")
            await self._deny(
                writer, shown, refusal, started, body=await self._body_facts(inner, reader)
            )
            return
        why_not = _not_a_read(inner, entry)
        if why_not is not None:
            body = await self._body_facts(inner, reader)
            await self._deny(writer, shown, Denied(403, why_not), started, body=body)
            return
        address, upstream_reader, upstream_writer = await self._dial(
            host, port, tls=self.upstream_tls, server_hostname=host
        )
        kind = "model call" if entry.model else "read"
        logged = self._begin(
            shown,
            f"allow-listed {kind} (inspected inside TLS)",
            category="model" if entry.model else "egress",
            detail={"resolved": address, "tls": "inspected"},
            upstream=upstream_writer,
        )
        upstream_writer.write(_origin_head(inner, inner.target, authority))
        await self._relay(
            logged, reader, writer, upstream_reader, upstream_writer, forward_client=entry.model
        )

    async def _dial(
        self,
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> tuple[str, asyncio.StreamReader, asyncio.StreamWriter]:
        """Resolve once, here, and dial exactly the addresses resolved (no rebinding window).

        Addresses are tried in the resolver's order; link-local, loopback and metadata
        addresses are skipped unless the allow list named the host as an address."""
        if _is_address(host):
            candidates = [host.strip("[]")]
        else:
            loop = asyncio.get_running_loop()
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
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        address, port, ssl=tls, server_hostname=server_hostname if tls else None
                    ),
                    CONNECT_TIMEOUT_S,
                )
                if tls is None and isinstance(writer.transport, asyncio.ReadTransport):
                    # Nothing is read until the relay decides how: the reply may be
                    # spliced past Python entirely (see _pipe_both).
                    writer.transport.pause_reading()
                return address, reader, writer
            except (OSError, TimeoutError, ssl.SSLError) as exc:
                failures.append(
                    f"{address}: {getattr(exc, 'strerror', None) or type(exc).__name__}"
                )
        raise Denied(502, f"cannot connect to {host}:{port} ({'; '.join(failures)})")

    # -- forwarding: a start line before the first byte leaves, an outcome after ----

    def _begin(
        self,
        request: _Request,
        reason: str,
        *,
        category: str,
        detail: dict[str, object],
        upstream: asyncio.StreamWriter,
    ) -> Started:
        """The start line; with the log full, the request is denied (the upstream closed)."""
        arguments, detail = self._facts(request, None, detail)
        try:
            return self.log.begin(
                session="egress",
                tool="http",
                decision="allow",
                reason=reason,
                category=category,
                arguments=arguments,
                detail=detail,
            )
        except LogFull as full:
            upstream.close()
            raise Denied(403, str(full)) from None

    async def _relay(
        self,
        logged: Started,
        client_reader: asyncio.StreamReader,
        client_writer: asyncio.StreamWriter,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
        *,
        zero_copy: bool = False,
        forward_client: bool = True,
    ) -> None:
        error = ""
        try:
            await _pipe_both(
                client_reader,
                client_writer,
                upstream_reader,
                upstream_writer,
                zero_copy=zero_copy,
                forward_client=forward_client,
            )
        except BaseException as exc:  # a cancelled relay (the guard stopping) included
            error = f"{type(exc).__name__}: {exc}"[:300]
            raise
        finally:
            self.log.outcome(logged, ok=not error, detail={"error": error} if error else {})

    # -- denial and records -------------------------------------------------------

    async def _body_facts(
        self, request: _Request, reader: asyncio.StreamReader
    ) -> dict[str, object]:
        """Size and hash of the request body (read, never forwarded, never logged)."""
        length = request.header("content-length")
        digest = hashlib.sha256()
        size = 0
        if length is not None and length.isdigit():
            remaining = int(length)
            while remaining > 0 and size < MAX_HASHED_BODY_BYTES:
                chunk = await asyncio.wait_for(reader.read(min(CHUNK, remaining)), 10)
                if not chunk:
                    break
                digest.update(chunk)
                size += len(chunk)
                remaining -= len(chunk)
            return {
                "body_bytes": size,
                "body_sha256": digest.hexdigest(),
                "body_truncated": remaining > 0,
            }
        if (request.header("transfer-encoding") or "").lower() == "chunked":
            return {"body_bytes": None, "body_sha256": None, "body_note": "chunked, not read"}
        return {"body_bytes": 0, "body_sha256": digest.hexdigest()}

    async def _deny(
        self,
        writer: asyncio.StreamWriter,
        request: _Request | None,
        denied: Denied,
        started: float,
        body: dict[str, object] | None,
    ) -> None:
        label = f"HTTP {request.method}" if request else "HTTP"
        text = stub_reply(label, denied.reason) + "\n"
        decision = "stub" if denied.status == 403 else "refuse"
        self._record(
            request,
            decision,
            denied.reason,
            started,
            category="egress",
            detail={"status": denied.status},
            body=body,
        )
        payload = text.encode()
        reason_phrase = {
            403: "Forbidden",
            400: "Bad Request",
            431: "Request Header Fields Too Large",
            502: "Bad Gateway",
            505: "HTTP Version Not Supported",
        }.get(denied.status, "Error")
        head = (
            f"HTTP/1.1 {denied.status} {reason_phrase}\r\n"
            "Content-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(payload)}\r\n"
            "X-Agentworks-Test-Mode: stubbed\r\n"
            "Connection: close\r\n\r\n"
        )
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode() + payload)
            await writer.drain()

    def _record(
        self,
        request: _Request | None,
        decision: str,
        reason: str,
        started: float,
        *,
        category: str,
        detail: dict[str, object] | None = None,
        body: dict[str, object] | None = None,
    ) -> None:
        arguments, detail = self._facts(request, body, detail)
        self.log.write(
            session="egress",
            tool="http",
            decision=decision,
            reason=reason,
            category=category,
            arguments=arguments,
            duration_ms=(time.perf_counter() - started) * 1000,
            detail=detail,
        )

    def _facts(
        self,
        request: _Request | None,
        body: dict[str, object] | None,
        detail: dict[str, object] | None,
    ) -> tuple[dict[str, object], dict[str, object]]:
        """A line's arguments (method, URL, body facts) and detail (host, calls in flight)."""
        arguments: dict[str, object] = {}
        if request is not None:
            arguments = {"method": request.method, "url": request.target}
        if body:
            arguments.update(body)
        detail = {**self.label, **(detail or {})}
        active = self.active_calls()
        if active:
            detail["active_tool_calls"] = active
        host = ""
        if request is not None:
            if request.method == "CONNECT":
                host = request.target.rpartition(":")[0].strip("[]")
            else:
                host = urlsplit(request.target).hostname or ""
        detail["host"] = host
        return arguments, detail


def _origin_head(request: _Request, target: str, host: str) -> bytes:
    """The request head as the real host gets it: origin-form target, our Host, no
    hop-by-hop or proxy headers, one request per connection."""
    head = [f"{request.method} {target} HTTP/1.1", f"Host: {host}"]
    head.extend(
        f"{k}: {v}"
        for k, v in request.headers
        if k.lower() not in HOP_BY_HOP and k.lower() != "host"
    )
    if request.header("transfer-encoding"):
        head.append(f"Transfer-Encoding: {request.header('transfer-encoding')}")
    head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while chunk := await src.read(CHUNK):
            dst.write(chunk)
            await dst.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if dst.can_write_eof():
                dst.write_eof()


def _not_a_read(request: _Request, entry: EgressEntry) -> str | None:
    """Why an allow-listed request may not pass as a read, or None when it may.

    A model endpoint takes any method. Anything else passes only as GET or HEAD
    without a body (its head is all that is forwarded; see `_discard`)."""
    if entry.model:
        return None
    if request.method not in READ_METHODS:
        return f"HTTP {request.method} can have effects; only GET and HEAD pass"
    length = (request.header("content-length") or "0").strip()
    if length != "0" or request.header("transfer-encoding") is not None:
        return "a read (GET or HEAD) carries no body; one that does is not forwarded"
    return None


async def _discard(src: asyncio.StreamReader, upstream: asyncio.StreamWriter) -> None:
    """What a reader sends after its head goes nowhere: a second, pipelined request
    would otherwise reach the outside unjudged. Its end still ends the upstream's half."""
    try:
        while await src.read(CHUNK):
            pass
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if upstream.can_write_eof():
                upstream.write_eof()


async def _splice_down(upstream: asyncio.StreamWriter, client: asyncio.StreamWriter) -> None:
    """The reply, upstream to client, inside the kernel; then end the client's half."""
    await splice.relay(upstream.get_extra_info("socket"), client.get_extra_info("socket"))
    with contextlib.suppress(Exception):
        if client.can_write_eof():
            client.write_eof()


async def _pipe_both(
    client_reader: asyncio.StreamReader,
    client_writer: asyncio.StreamWriter,
    upstream_reader: asyncio.StreamReader,
    upstream_writer: asyncio.StreamWriter,
    *,
    zero_copy: bool = False,
    forward_client: bool = True,
) -> None:
    """Relay until both ends are done.

    `zero_copy`: both connections are plain TCP and the upstream's transport has
    never read (`_dial` pauses it), so its bytes can be spliced to the client.
    `forward_client`: the client's further bytes go upstream (a model call's body,
    a tunnel); a read's head was all it may send."""
    # Splicing writes past the client's transport: only when it holds nothing unsent.
    if zero_copy and splice.AVAILABLE and client_writer.transport.get_write_buffer_size() == 0:
        down = _splice_down(upstream_writer, client_writer)
    else:
        if isinstance(upstream_writer.transport, asyncio.ReadTransport):
            upstream_writer.transport.resume_reading()
        down = _pump(upstream_reader, client_writer)
    try:
        up = (
            _pump(client_reader, upstream_writer)
            if forward_client
            else _discard(client_reader, upstream_writer)
        )
        await asyncio.gather(up, down)
    finally:
        with contextlib.suppress(Exception):
            upstream_writer.close()


@contextlib.asynccontextmanager
async def running(
    config: GuardConfig,
    log: ActionLog,
    active_calls: Callable[[], list[str]] | None = None,
    listener: socket.socket | None = None,
) -> AsyncIterator[EgressProxy]:
    """Serve the proxy on loopback for the guard's lifetime (on `listener` when given)."""
    proxy = EgressProxy(config, log, active_calls or (lambda: []))
    if config.egress.inspect_tls:
        from sandbox.guard.tls import CA_FILE, RunCA, upstream_context  # cryptography: on demand

        proxy.ca = RunCA(config.run_id)
        proxy.upstream_tls = upstream_context(config.egress_trust_pem)
        ca_path = os.path.join(config.data_dir, CA_FILE)
        fd = os.open(ca_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(proxy.ca.cert_pem())
    if listener is not None:
        server = await asyncio.start_server(proxy.handle, sock=listener, limit=MAX_HEAD_BYTES)
    else:
        server = await asyncio.start_server(
            proxy.handle, "127.0.0.1", config.egress_port, limit=MAX_HEAD_BYTES
        )
    try:
        yield proxy
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)
