"""The firewall's log of the step's refused packets, read by the guard (stdlib only).

The firewall REJECTs every packet of the step that is not TCP and not DNS (UDP,
ICMP, anything over IPv6) and, before it does, hands a copy of its first bytes
to netfilter log group `NFLOG_GROUP` (`sandbox.launch.firewall`). Binding a
socket to that group takes NET_ADMIN, which the guard never holds: the guard's
entry script runs `python -m sandbox.guard.nflogbind <command...>` while it is
still root with NET_ADMIN; that binds the socket, leaves it open (its number in
`NFLOG_FD_ENV`) and execs the rest of the entry (the drop to the guard's uid
with no capability at all, then the guard). Reading what the kernel sends to a
bound socket needs no capability; the guard can no longer change the binding,
and the step never holds the socket.

`packets()` turns what arrives into (protocol, destination, port) facts from the
packet's own headers, taken before any address rewrite (the nat table's log
rule), so what is recorded is where the step aimed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

from sandbox.contracts.guardprocess import NFLOG_FD_ENV
from sandbox.guard.nflogbind import NFNL_SUBSYS_ULOG as NFNL_SUBSYS_ULOG

NFULNL_MSG_PACKET = 0
NFULA_PAYLOAD = 9
NFULA_UID = 11
PROTOCOLS = {1: "icmp", 6: "tcp", 17: "udp", 58: "icmpv6", 132: "sctp", 136: "udplite"}


@dataclass(frozen=True)
class Packet:
    """One refused packet: where the step aimed it (port 0: a protocol without ports),
    its uid (None: no socket owned it) and the first bytes of its payload."""

    protocol: str
    destination: str
    port: int
    uid: int | None
    payload: bytes


def _transport(packet: bytes) -> tuple[int, str, int] | None:
    """(protocol number, destination, offset of the transport header) of an IP packet."""
    if len(packet) >= 20 and packet[0] >> 4 == 4:
        offset = (packet[0] & 0x0F) * 4
        return packet[9], str(ipaddress.IPv4Address(packet[16:20])), offset
    if len(packet) >= 40 and packet[0] >> 4 == 6:
        return packet[6], str(ipaddress.IPv6Address(packet[24:40])), 40
    return None


def parse_packet(packet: bytes, uid: int | None) -> Packet | None:
    head = _transport(packet)
    if head is None:
        return None
    number, destination, offset = head
    port, payload = 0, b""
    if number in (6, 17, 132, 136) and len(packet) >= offset + 4:
        port = struct.unpack_from("!H", packet, offset + 2)[0]
        if number in (17, 136):
            payload = packet[offset + 8 :]
    return Packet(PROTOCOLS.get(number, f"ip-proto-{number}"), destination, port, uid, payload)


def packets(data: bytes) -> list[Packet]:
    """The packets in one read of the bound socket (netlink messages, each with its
    attributes); anything that does not parse is skipped."""
    out: list[Packet] = []
    at = 0
    while at + 16 <= len(data):
        size, kind = struct.unpack_from("=IH", data, at)
        if size < 16 or at + size > len(data):
            break
        if kind == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET:
            payload, uid = b"", None
            attr = at + 20  # netlink header, then nfgenmsg
            while attr + 4 <= at + size:
                length, atype = struct.unpack_from("=HH", data, attr)
                if length < 4:
                    break
                value = data[attr + 4 : attr + length]
                atype &= 0x3FFF
                if atype == NFULA_PAYLOAD:
                    payload = value
                elif atype == NFULA_UID and len(value) == 4:
                    uid = struct.unpack("!I", value)[0]
                attr += (length + 3) & ~3
            packet = parse_packet(payload, uid)
            if packet is not None:
                out.append(packet)
        at += (size + 3) & ~3
    return out


def inherited() -> socket.socket | None:
    """The bound socket the entry left open for this process (None: there is none);
    taken once, and not passed on to anything this process starts."""
    raw = os.environ.pop(NFLOG_FD_ENV, None)
    if raw is None or not raw.isdigit():
        return None
    sock = socket.socket(fileno=int(raw))
    sock.set_inheritable(False)
    return sock
