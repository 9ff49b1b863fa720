"""The step's resolver: a DNS server on the guard that answers every name with the guard.

The firewall redirects every DNS query of the step (UDP or TCP port 53, to any
address) here, so no query ever leaves the run: nothing is forwarded, recursed or
cached from outside. An A query for a well-formed name gets a synthetic address
from `SYNTHETIC_V4` that this guard maps back to the name (`Names`); the firewall
redirects every TCP connection to the guard anyway, and the interception
(`sandbox.guard.egress.transparent`) judges it under that name, with the same allow list
as the explicit proxy (a name not on it: a plain-HTTP request is stubbed, TLS is
refused). The guard resolves the real address itself when it dials. AAAA, HTTPS
and SVCB get an empty answer (the client falls back to the A record); any other
type, an over-long or odd name, or a malformed query gets REFUSED or FORMERR.
Every query is one action-log line (tool `dns`: name, type, answer), capped and
hashed past a size as every argument is. dnslib reads and writes the wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import re
import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast

from dnslib import QTYPE, RCODE, RR, TXT, A, DNSError, DNSRecord

from sandbox.guard.actionlog import ActionLog, LogFull

SYNTHETIC_V4 = ipaddress.ip_network("198.18.0.0/15")  # firewall.SYNTHETIC_V4
TTL_S = 60
MAX_NAMES = 60000  # past it a new name gets REFUSED (the range holds 131072)
MAX_TCP_QUERY = 4096
TCP_READ_TIMEOUT_S = 5.0
EMPTY_TYPES = frozenset({"AAAA", "HTTPS", "SVCB"})
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
# The executor's preflight proves its queries reach this server, not another:
# `<nonce>.PREFLIGHT_ZONE` TXT is answered with HMAC-SHA256(bridge token, nonce).
PREFLIGHT_ZONE = "agentworks-preflight.invalid"
PREFLIGHT_UNLOGGED = 2  # the preflight's own probes (UDP, TCP); any later one is logged


def preflight_proof(key: str, nonce: str) -> str:
    return hmac.new(key.encode(), nonce.encode(), hashlib.sha256).hexdigest()


@dataclass
class Names:
    """The names this guard's DNS handed out, by synthetic address and back."""

    _by_name: dict[str, str] = field(default_factory=dict)
    _by_address: dict[str, str] = field(default_factory=dict)

    def address_for(self, name: str) -> str | None:
        """The synthetic address of `name` (a new one on first ask; None: range full)."""
        known = self._by_name.get(name)
        if known is not None:
            return known
        if len(self._by_name) >= MAX_NAMES:
            return None
        address = str(SYNTHETIC_V4[len(self._by_name) + 1])
        self._by_name[name] = address
        self._by_address[address] = name
        return address

    def name_of(self, address: str) -> str | None:
        return self._by_address.get(address)


def clean_name(qname: str) -> str | None:
    """`qname` lower-cased without its root dot, or None when it is not a plain host
    name (letters, digits, `-`, `_`; labels of 1-63; at most 253 in all)."""
    name = qname.lower().rstrip(".")
    if not name or len(name) > 253:
        return None
    if not all(_LABEL.fullmatch(label) for label in name.split(".")):
        return None
    return name


@dataclass
class DnsServer:
    log: ActionLog
    names: Names
    proof_key: str  # the bridge token: what only the guard and the step's executor hold
    queries: int = 0
    probes: int = 0

    def answer(self, data: bytes, transport: str) -> tuple[bytes | None, dict[str, object]]:
        """The reply to one query and the facts of its log line (no reply: not DNS)."""
        try:
            query = DNSRecord.parse(data)
        except (DNSError, struct.error, IndexError, ValueError, UnicodeError):
            return None, {"name": "", "type": "", "answer": "not a DNS query", "bytes": len(data)}
        reply = query.reply()
        reply.header.ra = 0
        if query.header.opcode != 0 or len(query.questions) != 1 or query.header.qr:
            reply.header.rcode = RCODE.FORMERR
            return reply.pack(), {"name": "", "type": "", "answer": "FORMERR"}
        question = query.q
        qtype = QTYPE.get(question.qtype, str(question.qtype))
        raw_name = str(question.qname)
        facts: dict[str, object] = {"name": raw_name.rstrip("."), "type": qtype}
        name = clean_name(raw_name)
        if name is None:
            reply.header.rcode = RCODE.REFUSED
            facts["answer"] = "REFUSED (not a plain host name)"
        elif qtype == "A":
            address = self.names.address_for(name)
            if address is None:
                reply.header.rcode = RCODE.REFUSED
                facts["answer"] = "REFUSED (too many names)"
            else:
                reply.add_answer(RR(question.qname, QTYPE.A, rdata=A(address), ttl=TTL_S))
                facts["answer"] = address
        elif qtype == "TXT" and name.endswith("." + PREFLIGHT_ZONE):
            nonce = name[: -len(PREFLIGHT_ZONE) - 1]
            proof = preflight_proof(self.proof_key, nonce)
            reply.add_answer(RR(question.qname, QTYPE.TXT, rdata=TXT(proof), ttl=0))
            self.probes += 1
            if self.probes <= PREFLIGHT_UNLOGGED:
                return reply.pack(), {}  # the executor's own check, before the step runs
            facts["answer"] = "preflight proof"
        elif qtype in EMPTY_TYPES:
            facts["answer"] = "no records"
        else:
            reply.header.rcode = RCODE.REFUSED
            facts["answer"] = f"REFUSED (type {qtype} is not served)"
        return reply.pack(), facts

    async def record(self, facts: dict[str, object], transport: str, started: float) -> None:
        """The query's one line, on disk before its answer goes out."""
        if not facts:
            return
        self.queries += 1
        answer = str(facts.get("answer", ""))
        refused = answer.startswith(("REFUSED", "FORMERR", "not a DNS"))
        with contextlib.suppress(LogFull):
            await self.log.write(
                session="egress",
                tool="dns",
                decision="refuse" if refused else "allow",
                reason=(
                    "answered by the guard's own DNS (nothing leaves the run)"
                    if not refused
                    else f"DNS query refused: {answer}"
                ),
                category="egress",
                arguments={"name": facts.get("name", ""), "type": facts.get("type", "")},
                duration_ms=(time.perf_counter() - started) * 1000,
                detail={"answer": answer, "transport": transport, "via": "direct"},
            )

    async def handle(self, data: bytes, transport: str) -> bytes | None:
        started = time.perf_counter()
        reply, facts = self.answer(data, transport)
        await self.record(facts, transport, started)
        return reply


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's UDP transport is not an asyncio.DatagramTransport subclass
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(data, addr))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = await self.server.handle(data, "udp")
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


async def _tcp_client(
    server: DnsServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """DNS over TCP: length-prefixed queries, until the client stops or idles."""
    try:
        while True:
            async with asyncio.timeout(TCP_READ_TIMEOUT_S):
                size = struct.unpack("!H", await reader.readexactly(2))[0]
                if size > MAX_TCP_QUERY:
                    await server.record(
                        {"name": "", "type": "", "answer": "REFUSED (oversized query)"},
                        "tcp",
                        time.perf_counter(),
                    )
                    return
                data = await reader.readexactly(size)
            reply = await server.handle(data, "tcp")
            if reply is None:
                return
            writer.write(struct.pack("!H", len(reply)) + reply)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def running(
    server: DnsServer, udp: socket.socket, tcp: socket.socket
) -> AsyncIterator[DnsServer]:
    """Serve DNS on the guard's sockets (UDP and TCP, already bound) for its lifetime."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(server), sock=udp)
    tcp_server = await asyncio.start_server(
        lambda r, w: _tcp_client(server, r, w), sock=tcp, limit=MAX_TCP_QUERY + 2
    )
    try:
        yield server
    finally:
        transport.close()
        tcp_server.close()
