"""The guard's listening sockets, bound before anything else it does (stdlib only).

Socket activation, as systemd does it: the ports are bound and listening within
milliseconds of the guard's start, while the slow part (importing the web stack,
~0.2 s) is still to come. A step's first call that arrives meanwhile waits in
the listen backlog and is served once the guard is up; it never finds a closed
port, and no process of the step can bind the guard's ports first (the step's
executor starts the step command only once the bridge port listens). The unix
sockets stdio MCP servers connect to are bound here too, so a server's relay
finds its socket within milliseconds of the guard's start.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket

from sandbox.contracts.guardprocess import BRIDGE_PORT as BRIDGE_PORT
from sandbox.contracts.guardprocess import CONFIG_FILE_ENV as CONFIG_FILE_ENV
from sandbox.contracts.guardprocess import DNS_PORT as DNS_PORT
from sandbox.contracts.guardprocess import EGRESS_PORT as EGRESS_PORT
from sandbox.contracts.guardprocess import TRANSPARENT_PORT as TRANSPARENT_PORT

BACKLOG = 512


def bind_udp_loopback(port: int) -> socket.socket:
    """A UDP socket bound to 127.0.0.1:`port` (the guard's DNS server)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def bind_loopback(port: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1:`port`.

    The protocol is named, not left 0: asyncio sets TCP_NODELAY only on sockets whose
    `proto` says TCP, and without it every keep-alive reply waits out the client's
    delayed ACK (40 ms per call)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def bind_unix(path: str, mode: int = 0o660) -> socket.socket:
    """A listening unix socket at `path` (a stale one is replaced), for one MCP server.

    The folder holding it is the guard's and lets only that server's group in;
    the socket itself is read-write for the guard and that group.

    It is bound under a staging name, given its mode and set listening there, and only
    then renamed to `path`, because the server's relay connects as soon as `path`
    exists: bound in place, the socket is first there with the umask's mode (no write
    for the group), and a relay that came in that moment got EACCES, which it rightly
    does not retry, so the server never started and every call to it was stubbed."""
    staging = f"{path}.binding"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for stale in (path, staging):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        sock.bind(staging)
        os.chmod(staging, mode)
        sock.listen(1)
        os.rename(staging, path)
    except BaseException:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise
    sock.set_inheritable(False)
    return sock


PR_SET_DUMPABLE = 4


def make_undumpable() -> bool:
    """prctl(PR_SET_DUMPABLE, 0): no process, even of the guard's own uid, may read this
    one's memory or environment through /proc or attach to it, and it leaves no core.

    A second layer: nothing else runs as the guard's uid. False when the call failed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
