"""The step's packets the firewall refused at once (UDP but DNS, ICMP, IPv6, other
protocols), put on the record.

The kernel REJECTs them (nothing is answered, nothing leaves) and copies each to the
guard's log socket first (`sandbox.guard.nflog`); here each packet a socket sent
(the kernel's own ICMP errors and resets have none) becomes an action-log
line: tool `packet`, arguments protocol, destination and port, decision `refuse`.
A flood must not flood the log: a (protocol, destination, port) gets a line at its
1st, 2nd, 4th, 8th... attempt, each with the count so far, and past MAX_KEYS
distinct ones every further key is counted under one `*` key the same way. The
record takes each key's highest count (`sandbox.collect.actionsummary`).

The executor's preflight sends one datagram and one connection to each canary before
the step starts; the first of each (per protocol) is left off the record, as the
guard's DNS and interception leave the preflight's own probes off.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sandbox.guard import nflog
from sandbox.guard.actionlog import ActionLog, LogFull

MAX_KEYS = 1000
READ_BYTES = 1 << 17


def _canary_key(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]"), int(port)


@dataclass
class PacketRecorder:
    log: ActionLog
    canaries: list[str] = field(default_factory=list)
    counts: dict[tuple[str, str, int], int] = field(default_factory=dict)
    _preflight: set[tuple[str, str, int]] = field(default_factory=set)
    lost_reads: int = 0

    def _is_preflight(self, packet: nflog.Packet) -> bool:
        """The first packet per protocol to a canary (the preflight's own check)."""
        aimed = (packet.destination, packet.port)
        if not any(_canary_key(c) == aimed for c in self.canaries):
            return False
        key = (packet.protocol, packet.destination, packet.port)
        if key in self._preflight:
            return False
        self._preflight.add(key)
        return True

    async def add(self, packet: nflog.Packet) -> None:
        # No owner: the kernel's own answer to a refused packet (its ICMP error or
        # reset), not an attempt of anyone's.
        if packet.uid is None or self._is_preflight(packet):
            return
        key = (packet.protocol, packet.destination, packet.port)
        if key not in self.counts and len(self.counts) >= MAX_KEYS:
            key = (packet.protocol, "*", 0)
        count = self.counts.get(key, 0) + 1
        self.counts[key] = count
        if count & (count - 1):
            return  # a line at each power of two
        detail: dict[str, object] = {"count": count, "via": "direct", "uid": packet.uid}
        if packet.payload:
            detail["first_bytes"] = len(packet.payload)
            detail["first_sha256"] = hashlib.sha256(packet.payload).hexdigest()
        port = f" port {key[2]}" if key[2] else ""
        with contextlib.suppress(LogFull):
            await self.log.write(
                session="egress",
                tool="packet",
                decision="refuse",
                reason=(
                    f"{key[0]} to {key[1]}{port} refused by the firewall: only TCP and DNS"
                    " reach the guard, nothing else leaves the run"
                ),
                category="egress",
                arguments={"protocol": key[0], "destination": key[1], "port": key[2]},
                duration_ms=None,
                detail=detail,
            )

    async def drain(self, sock: socket.socket) -> None:
        """Record every copy waiting in the socket."""
        while True:
            try:
                data = sock.recv(READ_BYTES)
            except BlockingIOError:
                return
            except OSError:
                # ENOBUFS: the kernel dropped copies not read yet; those attempts still
                # met the REJECT, only their count is short.
                self.lost_reads += 1
                if self.lost_reads == 1:
                    await self._note_lost()
                continue
            for packet in nflog.packets(data):
                await self.add(packet)

    async def serve(self, sock: socket.socket) -> None:
        """Read the log socket until cancelled (readiness by hand: uvloop's sock_recv
        does not take a netlink socket)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop.add_reader(sock.fileno(), ready.set)
        try:
            while True:
                await ready.wait()
                ready.clear()
                await self.drain(sock)
        finally:
            loop.remove_reader(sock.fileno())

    async def _note_lost(self) -> None:
        with contextlib.suppress(LogFull):
            await self.log.write(
                session="egress",
                tool="packet",
                decision="refuse",
                reason="refused packets came faster than the guard read them: counts are short",
                category="egress",
                arguments={"protocol": "*", "destination": "*", "port": 0},
                duration_ms=None,
                detail={"count": 0, "lost": True, "at": time.time()},
            )


@contextlib.asynccontextmanager
async def logging_refused(
    log: ActionLog, canaries: list[str], sock: socket.socket | None
) -> AsyncIterator[PacketRecorder | None]:
    """Record the refused packets arriving on `sock` for the guard's lifetime (None:
    the firewall logs none here, as in a Pod, whose init container keeps no socket)."""
    if sock is None:
        yield None
        return
    recorder = PacketRecorder(log, list(canaries))
    sock.setblocking(False)
    task = asyncio.get_running_loop().create_task(recorder.serve(sock))
    try:
        yield recorder
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        # The step is done: what it sent last is already in the socket (the kernel
        # copies each packet before the send returns); record it before the log closes.
        with contextlib.suppress(Exception):
            await recorder.drain(sock)
        sock.close()
