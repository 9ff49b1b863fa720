"""The guard's client for the real bridge: h11's HTTP/1.1 on asyncio streams, no retries.

A forwarded call's bytes are written at most once. A kept-alive connection is
reused only when h11 says both sides finished the last exchange cleanly and,
just before the request goes out, the socket shows no sign of the server's
close (a non-blocking peek: EOF or stray bytes retire it). Once the first byte
of a request is written, any failure (reset, close, malformed reply, timeout)
is that call's error, reported with `sent=True`, and never a reason to send it
again: the upstream may have run it. Only a connection that could not be made
is reported with `sent=False`.

Why not httpx here: it is on every allowed call's path, and on this machine
httpx cost 1.5 ms more CPU per call than this (httpcore alone 0.8 ms), against
a per-call budget for the guard of under 1 ms. h11 does all the framing (the
same parser the egress proxy uses); what is here is the I/O around it.
Limits: replies over `caps.MAX_UPSTREAM_REPLY_BYTES` (8 MiB) are refused
(`ReplyTooLarge`, never read whole); at most 8 idle connections are kept;
no redirects, no proxies from the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11

from sandbox.guard.caps import MAX_UPSTREAM_REPLY_BYTES

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = MAX_UPSTREAM_REPLY_BYTES
MAX_IDLE = 8
CHUNK = 256 * 1024


class UpstreamError(Exception):
    """The exchange failed. `sent`: the request's bytes (some of them) went out, so the
    upstream may have acted on it."""

    def __init__(self, reason: str, *, sent: bool) -> None:
        super().__init__(reason)
        self.sent = sent


class ReplyTooLarge(UpstreamError):
    """The reply's body is larger than MAX_BODY_BYTES (never read whole). The request
    went out, so this is always `sent=True`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, sent=True)


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection

    def looks_open(self) -> bool:
        """No EOF and nothing unasked-for waiting: the server has not closed it. Polled on
        the socket itself, so a close that arrived while the loop was busy counts too."""
        if self.reader.at_eof() or self.writer.is_closing():
            return False
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        return not poller.poll(0)  # readable: EOF, or bytes nobody asked for

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class UpstreamClient:
    def __init__(self, base_url: str) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._tls = url.scheme == "https"
        self._context: ssl.SSLContext | None = None
        self._authority = url.netloc.encode("ascii")
        self._prefix = url.path.rstrip("/")
        self._idle: list[_Connection] = []

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> Reply:
        """One POST; wrap it in a timeout (a cancelled exchange closes its connection)."""
        conn = await self._connection()
        done = False
        try:
            request = h11.Request(
                method="POST",
                target=(self._prefix + path).encode("ascii"),
                headers=[
                    (b"Host", self._authority),
                    *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
                    (b"Content-Length", str(len(body)).encode("ascii")),
                ],
            )
            data = b"".join(
                part or b""
                for part in (
                    conn.h11.send(request),
                    conn.h11.send(h11.Data(data=body)) if body else b"",
                    conn.h11.send(h11.EndOfMessage()),
                )
            )
            try:
                conn.writer.write(data)
                await conn.writer.drain()
                reply = await _read_reply(conn)
            except (OSError, asyncio.IncompleteReadError) as exc:
                reason = f"the connection failed after the call was sent: {_why(exc)}"
                raise UpstreamError(reason, sent=True) from exc
            except h11.ProtocolError as exc:
                raise UpstreamError(f"malformed reply: {exc}", sent=True) from exc
            done = True
            return reply
        finally:
            if done and conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
                conn.h11.start_next_cycle()
                if len(self._idle) < MAX_IDLE:
                    self._idle.append(conn)
                else:
                    conn.close()
            else:
                conn.close()

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if conn.looks_open():
                return conn
            conn.close()
        if self._tls and self._context is None:
            self._context = ssl.create_default_context()
        try:
            reader, writer = await asyncio.open_connection(
                self._host, self._port, ssl=self._context, limit=MAX_HEAD_BYTES
            )
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamError(f"cannot connect: {_why(exc)}", sent=False) from exc
        return _Connection(reader, writer, h11.Connection(h11.CLIENT, MAX_HEAD_BYTES))


async def _read_reply(conn: _Connection) -> Reply:
    status = 0
    body = bytearray()
    while True:
        event = conn.h11.next_event()
        if event is h11.NEED_DATA:
            conn.h11.receive_data(await conn.reader.read(CHUNK))
        elif isinstance(event, h11.Response):
            status = event.status_code
            declared = dict(event.headers).get(b"content-length", b"")
            if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
                raise ReplyTooLarge(f"reply of {int(declared)} bytes, over {MAX_BODY_BYTES}")
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_BODY_BYTES:
                raise ReplyTooLarge(f"reply larger than {MAX_BODY_BYTES} bytes")
        elif isinstance(event, h11.EndOfMessage):
            return Reply(status, bytes(body))
        elif isinstance(event, h11.ConnectionClosed):
            raise UpstreamError("the upstream closed the connection without a reply", sent=True)


def _why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
