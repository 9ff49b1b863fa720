"""The guard entry's moment as root: bind the firewall's packet log, then exec the rest.

`python -m sandbox.guard.nflogbind <command...>` runs in the guard's entry while it
still holds NET_ADMIN (`sandbox.launch.firewall`): it binds a netlink socket to the
log group the firewall copies the step's refused packets to, leaves it open (its
number in `NFLOG_FD_ENV`) and execs the drop to the guard's uid, then the guard
(`sandbox.guard.nflog` reads what arrives). This interpreter is on the path to the
guard's first answer and does nothing else, so it imports only what binding takes
(os, socket, struct: no dataclasses, no ipaddress, no pydantic): a test pins that.
"""

from __future__ import annotations

import os
import socket
import struct
import sys

from sandbox.contracts.guardprocess import NFLOG_FD_ENV, NFLOG_GROUP

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_CONFIG = 1
NFULA_CFG_CMD = 1
NFULA_CFG_MODE = 2
NFULA_CFG_TIMEOUT = 4
NFULA_CFG_QTHRESH = 5
NFULNL_CFG_CMD_BIND = 1
NFULNL_COPY_PACKET = 2
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
NLM_F_ACK = 4
COPY_BYTES = 128  # the IP and transport headers, and a datagram's first bytes
# Each packet's copy is in the socket before the step's send returns (no batching),
# so the guard, draining the socket as it stops, never misses one.
QUEUE_THRESHOLD = 1
FLUSH_CENTISECONDS = 1
RECEIVE_BUFFER = 1 << 20


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
