"""The step's end of one connection to the egress proxy (and, for one the firewall
redirected, where it was going: `Direct`), and its lingering close.

On plain TCP every write waits until the kernel holds all of it, so nothing stays
queued in Python and a reply body can be spliced straight after its head (TLS
connections are never spliced into and keep the transport's own buffer).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sandbox.guard.egress import http1, splice
from sandbox.guard.egress.http1 import Denied

if TYPE_CHECKING:
    from sandbox.guard.recording import Tap

CHUNK = 256 * 1024
LINGER_S, LINGER_IDLE_S, LINGER_BYTES = 2.0, 0.2, 1024 * 1024  # after a denial


@dataclass(frozen=True)
class Direct:
    """A connection the firewall redirected to the guard (`egress.transparent`):
    the name it was for (the one the guard's DNS handed out for `address`, else the
    address itself) and its original port. A request on it names no host in its target:
    its Host header must name exactly `name` and `port`."""

    name: str
    port: int
    address: str

    def target(self, raw: bytes) -> http1.Target:
        text = raw.decode("ascii")
        if not text.startswith("/") or "#" in text:
            raise Denied(400, "a request sent straight to a host needs a path target (/...)")
        return http1.Target(self.name, self.port, text)


class Client:
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
        self.tap: Tap | None = None  # the reply being recorded: every byte goes through write
        if writer.get_extra_info("ssl_object") is None:
            # Plain TCP only: a reply body is spliced past Python only after the head
            # has all reached the kernel. A TLS transport is never spliced into, and
            # given no buffer its drain can stall under load (a redirected TLS
            # connection's reply head went out and its body never followed).
            writer.transport.set_write_buffer_limits(high=0)

    async def write(self, data: bytes) -> None:
        if self.tap is not None:
            self.tap.feed(data)
        writer = self.writer
        writer.write(data)
        transport = writer.transport
        # All of it in the kernel and the connection open: `drain` would find nothing
        # to wait for and no loss to raise (a lost connection closes the transport), so
        # it is not awaited; else it waits, or raises the loss, as always.
        if transport.get_write_buffer_size() or transport.is_closing():
            await writer.drain()

    def splice_socket(self) -> socket.socket | None:
        """The socket to splice a reply into: plain TCP with nothing queued in Python."""
        if self.tls or not splice.AVAILABLE or (self.tap is not None and self.tap.keeping):
            return None
        if self.writer.transport.get_write_buffer_size() != 0:
            return None
        sock: socket.socket | None = self.writer.get_extra_info("socket")
        return sock


async def read_within(reader: asyncio.StreamReader, size: int, seconds: float) -> bytes:
    """`reader.read(size)`, or TimeoutError after `seconds`: `asyncio.timeout`'s own
    behaviour (the task cancelled at the deadline, that cancellation alone turned into
    TimeoutError, any other passed on) with one timer and no context object, task
    look-up and state per read (every request of a kept-alive connection reads twice)."""
    task = asyncio.current_task()
    assert task is not None
    cancelling = task.cancelling()
    expired: list[bool] = []

    def expire() -> None:
        expired.append(True)
        task.cancel()

    timer = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        data = await reader.read(size)
    except BaseException as exc:
        timer.cancel()
        if expired and task.uncancel() <= cancelling and isinstance(exc, asyncio.CancelledError):
            raise TimeoutError from exc
        raise
    timer.cancel()
    if expired:  # it fired as the read ended: its cancel is taken back, as asyncio's is
        task.uncancel()
    return data


async def linger(client: Client) -> None:
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
