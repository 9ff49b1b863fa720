"""Transparent egress: the step's direct TCP connections, redirected here by the firewall.

Every TCP connection the step opens to a non-loopback address lands on this
listener (iptables REDIRECT: `sandbox.launch.firewall.nat_rules`); the original
destination comes back from the kernel (SO_ORIGINAL_DST). The connection is
judged by its first bytes, read within FIRST_READ_S (peeked, never consumed):

* HTTP/1.x goes to the egress proxy's own code path (`EgressProxy.handle` with a
  `Direct`): the same strict parse, policy, stub text and log line, and the Host
  header must name the destination (the name the guard's DNS handed out for that
  address, else the address itself) and port.
* TLS: the ClientHello's SNI is read, then treated as a CONNECT to that name would
  be (inspected by default, the per-host opt-out a blind relay); an SNI that is not
  the destination's name, or a host not on the allow list, is refused and recorded.
* Anything else, or nothing within FIRST_READ_S, is refused, recorded (destination,
  port, the first bytes' size and SHA-256) and closed at once.

Every line says `via: direct` and the original `destination`. The executor's
preflight proves its canary connection landed here (`PREFLIGHT_PROBE`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import socket
import struct
import time
from collections.abc import AsyncIterator

from sandbox.guard.egress import dns, http1, request, splice
from sandbox.guard.egress.connection import Client, Direct
from sandbox.guard.egress.dns import Names, preflight_proof
from sandbox.guard.egress.http1 import Denied
from sandbox.guard.egress.proxy import READ_TIMEOUT_S, EgressProxy
from sandbox.guard.egress.request import Seen

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
FIRST_READ_S = 3.0
MAX_HELLO = 5 + 16384  # one TLS record
PEEK_STEP_S = 0.005  # between peeks of a first read that is still arriving
_HTTP_START = re.compile(rb"[A-Z]{3,20} ")
PREFLIGHT_PROBE = b"AGENTWORKS-PREFLIGHT "
PREFLIGHT_UNLOGGED = 1


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where the step meant to connect (the kernel's record of the redirect)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port = struct.unpack_from("!H", raw, 2)[0]
    return socket.inet_ntoa(raw[4:8]), port


def classify(first: bytes) -> str | None:
    """ "http", "tls", "other", or None: too few bytes to say yet."""
    if _HTTP_START.match(first):
        return "http"
    if first[:1] == b"\x16":
        if len(first) < 5:
            return None
        if first[1] == 3:
            length = struct.unpack_from("!H", first, 3)[0]
            return "tls" if len(first) >= 5 + length else None
        return "other"
    if first.startswith(PREFLIGHT_PROBE):
        return "probe" if b"\n" in first else None
    if re.fullmatch(rb"[A-Z]{0,20}", first) or PREFLIGHT_PROBE.startswith(first):
        return None  # a method, or the probe, still arriving
    return "other"


def server_name(record: bytes) -> str | None:
    """The SNI host name of a ClientHello in one TLS record; None when there is none.
    ValueError when it is not a well-formed ClientHello."""
    try:
        if record[0] != 0x16 or record[5] != 0x01:
            raise ValueError("not a TLS ClientHello")
        at = 9 + 2 + 32  # record head, handshake head, client version, random
        at += 1 + record[at]  # session id
        at += 2 + struct.unpack_from("!H", record, at)[0]  # cipher suites
        at += 1 + record[at]  # compression methods
        if at == len(record):
            return None
        end = at + 2 + struct.unpack_from("!H", record, at)[0]
        at += 2
        if end > len(record):
            raise ValueError("the extensions run past the record")
        while at + 4 <= end:
            kind, size = struct.unpack_from("!HH", record, at)
            at += 4
            if kind == 0:
                name_type, length = struct.unpack_from("!BH", record, at + 2)
                if name_type != 0:
                    raise ValueError("an SNI entry that is not a host name")
                name = record[at + 5 : at + 5 + length]
                if len(name) != length:
                    raise ValueError("the SNI runs past the record")
                return name.decode("ascii").lower().rstrip(".")
            at += size
    except (IndexError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"a malformed ClientHello ({exc})") from None
    return None


async def _first_bytes(sock: socket.socket) -> bytes:
    """What the step sent first (peeked, still in the socket), once it says what it is or
    FIRST_READ_S passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FIRST_READ_S
    data = b""
    while (left := deadline - loop.time()) > 0:
        try:
            data = sock.recv(MAX_HELLO, socket.MSG_PEEK)
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_reader(sock.fileno(), ready.set_result, None)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ready, left)
            finally:
                loop.remove_reader(sock.fileno())
            continue
        if not data or classify(data) is not None or len(data) >= MAX_HELLO:
            return data
        await asyncio.sleep(PEEK_STEP_S)  # more of a started first message is on its way
    return data


class Interceptor:
    """The listener's per-connection work: recover, sniff, hand to the proxy."""

    def __init__(self, proxy: EgressProxy, names: Names, proof_key: str) -> None:
        self.proxy = proxy
        self.names = names
        self.proof_key = proof_key
        self.probes = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def serve(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        while True:
            sock, _ = await loop.sock_accept(listener)
            task = loop.create_task(self.one(sock))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def one(self, sock: socket.socket) -> None:
        started = time.perf_counter()
        handed = False
        try:
            sock.setblocking(False)
            address, port = original_destination(sock)
            direct = Direct(self.names.name_of(address) or address, port, address)
            first = await _first_bytes(sock)
            kind = classify(first) if first else None
            if kind == "http":
                handed = True
                reader, writer = await asyncio.open_connection(
                    sock=sock, limit=http1.MAX_HEAD_BYTES
                )
                await self.proxy.handle(reader, writer, direct=direct)
            elif kind == "tls":
                handed = await self._tls(sock, direct, first, started)
            elif kind == "probe" and self.probes < PREFLIGHT_UNLOGGED:
                self.probes += 1
                nonce = first[len(PREFLIGHT_PROBE) :].split(b"\n", 1)[0].strip()
                proof = preflight_proof(self.proof_key, nonce.decode("ascii", "replace"))
                await asyncio.get_running_loop().sock_sendall(sock, proof.encode() + b"\n")
            else:
                await self._refuse_other(direct, first, started)
        except OSError:
            pass
        finally:
            if not handed:
                sock.close()

    async def _tls(self, sock: socket.socket, direct: Direct, hello: bytes, started: float) -> bool:
        """Judge a TLS connection by its SNI; True when a stream now owns the socket."""
        seen = self._seen(direct, "TLS")
        try:
            sni = server_name(hello)
        except ValueError as exc:
            await self._refuse(seen, str(exc), started)
            return False
        host = sni or direct.name
        seen.host, seen.url = host, f"https://{host}:{direct.port}/"
        if sni is not None and sni != direct.name:
            reason = f"the TLS server name ({sni}) is not the destination's ({direct.name})"
            await self._refuse(seen, reason, started)
            return False
        entry = request.match(self.proxy.config.egress, host, direct.port, tunnel=True)
        if entry is None:
            reason = f"TLS to {host}:{direct.port} is not on the egress allow list"
            await self._refuse(seen, reason, started)
            return False
        loop = asyncio.get_running_loop()
        direct = Direct(host, direct.port, direct.address)
        if not self.proxy.config.egress.inspects(entry):
            reader, writer = await asyncio.open_connection(sock=sock)
            client = Client(reader, writer, 0)
            client.direct = direct
            seen.method = "CONNECT"
            try:
                await self.proxy.blind_tunnel(client, host, direct.port, entry, seen, started)
            except Denied as denied:
                await self._refuse(seen, denied.reason, started)
            finally:
                writer.close()
            return True
        try:
            context = self.proxy.tls.for_step(host)
        except Denied as denied:
            await self._refuse(seen, denied.reason, started)
            return False
        reader = asyncio.StreamReader(limit=http1.MAX_HEAD_BYTES)
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol, sock, ssl=context, ssl_handshake_timeout=READ_TIMEOUT_S
            )
        except (OSError, TimeoutError) as exc:
            seen.tls = "inspected"
            await self._refuse(
                seen, f"the step's TLS handshake with the guard failed: {exc}", started
            )
            return True  # the failed transport closed the socket
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        await self.proxy.handle(reader, writer, direct=direct, tunnel=(host, direct.port, entry))
        return True

    def _seen(self, direct: Direct, method: str) -> Seen:
        seen = Seen(method=method, host=direct.name, via="direct")
        seen.destination = f"{direct.address}:{direct.port}"
        return seen

    async def _refuse(self, seen: Seen, reason: str, started: float) -> None:
        with contextlib.suppress(Exception):
            await self.proxy.record(seen, "refuse", reason, started, status=None)

    async def _refuse_other(self, direct: Direct, first: bytes, started: float) -> None:
        seen = self._seen(direct, "TCP")
        seen.url = f"tcp://{direct.name}:{direct.port}"
        body = {"first_bytes": len(first), "first_sha256": hashlib.sha256(first).hexdigest()}
        reason = (
            "nothing arrived within the first-read wait"
            if not first
            else "neither HTTP/1.x nor TLS: other protocols are not forwarded"
        )
        with contextlib.suppress(Exception):
            await self.proxy.record(seen, "refuse", reason, started, status=None, body=body)


@contextlib.asynccontextmanager
async def running(
    proxy: EgressProxy, names: Names, proof_key: str, listener: socket.socket
) -> AsyncIterator[Interceptor]:
    """Accept redirected connections on `listener` for the guard's lifetime, each born
    with the congestion control the proxy's own connections have (`splice.unpaced`): a
    redirected connection is the step's loopback to the guard all the same, and its
    reply body is spliced by the same relay."""
    splice.unpaced(listener)  # before the first connection is accepted
    interceptor = Interceptor(proxy, names, proof_key)
    task = asyncio.get_running_loop().create_task(interceptor.serve(listener))
    try:
        yield interceptor
    finally:
        task.cancel()
        for one in list(interceptor.tasks):
            one.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


@contextlib.asynccontextmanager
async def serving(
    proxy: EgressProxy,
    proof_key: str,
    listeners: tuple[socket.socket, socket.socket, socket.socket] | None,
) -> AsyncIterator[None]:
    """The guard's DNS server and the interception listener, sharing one map of the
    names handed out (`listeners`: interception TCP, DNS UDP, DNS TCP; None: neither)."""
    if listeners is None:
        yield
        return
    names = Names()
    server = dns.DnsServer(proxy.log, names, proof_key)
    intercept, udp, tcp = listeners
    async with dns.running(server, udp, tcp), running(proxy, names, proof_key, intercept):
        yield
