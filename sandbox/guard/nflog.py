"""The firewall's log of the step's refused packets, read by the guard (stdlib only).

The firewall REJECTs every packet of the step that is not TCP and not DNS (UDP,
ICMP, anything over IPv6) and, before it does, hands a copy of its first bytes
to netfilter log group `NFLOG_GROUP` (`sandbox.launch.firewall`). Binding a
socket to that group takes NET_ADMIN, which the guard never holds: the guard's
entry script runs `python -m sandbox.guard.nflog <command...>` while it is still
root with NET_ADMIN; that binds the socket, leaves it open (its number in
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
import sys
from dataclasses import dataclass

from sandbox.contracts.guardprocess import NFLOG_FD_ENV, NFLOG_GROUP

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET = 0
NFULNL_MSG_CONFIG = 1
NFULA_CFG_CMD = 1
NFULA_CFG_MODE = 2
NFULA_CFG_TIMEOUT = 4
NFULA_CFG_QTHRESH = 5
NFULNL_CFG_CMD_BIND = 1
NFULNL_COPY_PACKET = 2
NFULA_PAYLOAD = 9
NFULA_UID = 11
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
NLM_F_ACK = 4
COPY_BYTES = 128  # the IP and transport headers, and a datagram's first bytes
# Each packet's copy is in the socket before the step's send returns (no batching),
# so the guard, draining the socket as it stops, never misses one.
QUEUE_THRESHOLD = 1
FLUSH_CENTISECONDS = 1
RECEIVE_BUFFER = 1 << 20
PROTOCOLS = {1: "icmp", 6: "tcp", 17: "udp", 58: "icmpv6", 132: "sctp", 136: "udplite"}


def _config(seq: int, attrs: list[tuple[int, bytes]]) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(NFLOG_GROUP))
    for kind, value in attrs:
        size = 4 + len(value)
        body += struct.pack("=HH", size, kind) + value + b"\0" * (-size % 4)
    kind = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG
    return struct.pack("=IHHII", 16 + len(body), kind, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def _acked(sock: socket.socket, seq: int) -> None:
    reply = sock.recv(65536)
    size, kind, _, got, _ = struct.unpack_from("=IHHII", reply)
    if kind != NLMSG_ERROR or got != seq or size < 20:
        raise OSError(f"nflog: an unexpected netlink reply (type {kind})")
    error = struct.unpack_from("=i", reply, 16)[0]
    if error:
        raise OSError(-error, f"nflog config refused: {os.strerror(-error)}")


def bind_group() -> socket.socket:
    """A netlink socket bound to NFLOG_GROUP, copying COPY_BYTES of each packet
    (needs NET_ADMIN in the network namespace: the entry's moment as root)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        sock.bind((0, 0))
        steps = [
            [(NFULA_CFG_CMD, struct.pack("B", NFULNL_CFG_CMD_BIND))],
            [(NFULA_CFG_MODE, struct.pack("!IBB", COPY_BYTES, NFULNL_COPY_PACKET, 0))],
            [(NFULA_CFG_QTHRESH, struct.pack("!I", QUEUE_THRESHOLD))],
            [(NFULA_CFG_TIMEOUT, struct.pack("!I", FLUSH_CENTISECONDS))],
        ]
        for seq, attrs in enumerate(steps, start=1):
            sock.send(_config(seq, attrs))
            _acked(sock, seq)
    except BaseException:
        sock.close()
        raise
    return sock


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


def main(argv: list[str]) -> int:
    """Bind the group, then exec `argv` with the socket open (the entry's next step)."""
    if not argv:
        print("nflog: no command to run", file=sys.stderr)
        return 2
    sock = bind_group()
    sock.set_inheritable(True)
    os.environ[NFLOG_FD_ENV] = str(sock.fileno())
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
