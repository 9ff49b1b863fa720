"""The guard's client for the real bridge and the step's executor: HTTP/1.1 on an
asyncio protocol, parsed by httptools (llhttp, the bridge port's parser), no retries.

The bytes go to llhttp from the protocol's own callback, with no stream reader
between, which keeps a forwarded call's CPU small. A call's bytes are written at
most once; its contract is `sandbox.guard.bridge.upstream`'s (see bridge.spec.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
from urllib.parse import urlsplit

import httptools

from sandbox.guard.bridge.upstream import Reply, ReplyTooLarge, UpstreamError
from sandbox.guard.limits import MAX_UPSTREAM_REPLY_BYTES

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = MAX_UPSTREAM_REPLY_BYTES
MAX_IDLE = 8
MAX_HEADS = 16  # request heads remembered (path and headers): a guard sends one or two
_CLOSED = "the upstream closed the connection without a reply"


def _field(value: str) -> bytes:
    raw = value.encode("latin-1")
    # Checked on the text, which latin-1 maps byte for byte: `bytes in bytes` first
    # tries the operand as an integer and raises and clears a TypeError each time
    # (twelve per forwarded call, 2.6% of its instructions).
    if "\r" in value or "\n" in value or "\0" in value:
        raise ValueError(f"a header may not hold a line break or NUL: {value!r}")
    return raw


class _Connection(asyncio.Protocol):
    """One connection to the upstream and the exchange on it (at most one at a time)."""

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reply: asyncio.Future[Reply] | None = None
        self.reusable = False  # the last reply ended cleanly with keep-alive
        self.lost = False
        self._status = 0
        self._body = bytearray()
        self._head_bytes = 0  # bytes read while the head is incomplete
        self._header_bytes = 0  # the head's header lines
        self._in_head = True
        self._delimited = False  # the body has a length or is chunked (else: until close)
        self._poller: select.poll | None = None

    # -- the exchange -------------------------------------------------------------

    def begin(self, loop: asyncio.AbstractEventLoop, data: bytes) -> asyncio.Future[Reply]:
        if self.transport is None or self.transport.is_closing() or self.lost:
            raise UpstreamError("the connection closed before the call was sent", sent=False)
        self.reusable = False  # until this exchange is seen to end cleanly
        self.reply = loop.create_future()
        self._reset()
        self.transport.write(data)
        return self.reply

    def _reset(self) -> None:
        self._status = 0
        self._body = bytearray()
        self._head_bytes = 0
        self._header_bytes = 0
        self._in_head = True
        self._delimited = False

    def _fail(self, error: UpstreamError) -> None:
        reply, self.reply = self.reply, None
        if reply is not None and not reply.done():
            reply.set_exception(error)
        self.close()

    def looks_open(self) -> bool:
        """No EOF and nothing unasked-for waiting: the server has not closed it. Polled on
        the socket itself, so a close that arrived while the loop was busy counts too."""
        if self.lost or self.transport is None or self.transport.is_closing():
            return False
        if self._poller is None:  # one per connection: its socket's fd stays the same
            sock: socket.socket | None = self.transport.get_extra_info("socket")
            if sock is None:
                return False
            self._poller = select.poll()
            self._poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        return not self._poller.poll(0)  # readable: EOF, or bytes nobody asked for

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    # -- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (TCP)

    def data_received(self, data: bytes) -> None:
        if self.reply is None:  # bytes nobody asked for: the connection is not trusted
            self.close()
            return
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed reply: {exc}", sent=True))
            return
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("malformed reply: an upgrade", sent=True))
            return
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES and self.reply is not None:
            self._fail(UpstreamError("malformed reply: its head is too large", sent=True))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.reusable = False
        reply = self.reply
        if reply is None or reply.done():
            return
        if not self._in_head and not self._delimited:  # a body that ends with the close
            self.reply = None
            reply.set_result(Reply(self._status, bytes(self._body)))
            return
        why = f"{_CLOSED} ({exc})" if exc else _CLOSED
        self._fail(UpstreamError(why, sent=True))

    # -- httptools callbacks ------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.reply is None:  # a reply nobody asked for (past the last one's end)
            self.close()
            return
        self._reset()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4
        lowered = name.lower()
        if lowered == b"content-length":
            self._delimited = True
            if value.strip().isdigit() and int(value) > self.max_body:
                self._fail(ReplyTooLarge(f"reply of {int(value)} bytes, over {self.max_body}"))
        elif lowered == b"transfer-encoding":
            self._delimited = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._status = self.parser.get_status_code()
        if self._header_bytes > MAX_HEAD_BYTES:  # a whole head that came in one read
            self._fail(UpstreamError("malformed reply: its head is too large", sent=True))

    def on_body(self, body: bytes) -> None:
        if self.reply is None:
            return
        self._body += body
        if len(self._body) > self.max_body:
            self._fail(ReplyTooLarge(f"reply larger than {self.max_body} bytes"))

    def on_message_complete(self) -> None:
        if 100 <= self._status < 200:  # an interim reply: the real one follows
            return
        reply, self.reply = self.reply, None
        if reply is None or reply.done():
            self.close()
            return
        self.reusable = self.parser.should_keep_alive() and not self.lost
        reply.set_result(Reply(self._status, bytes(self._body)))


class BridgeClient:
    """Keep-alive POSTs to one upstream base URL (http or https), a request in one write."""

    def __init__(self, base_url: str, *, max_body: int = MAX_BODY_BYTES) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._tls = url.scheme == "https"
        self._context: ssl.SSLContext | None = None
        self._authority = _field(url.netloc)
        self._prefix = url.path.rstrip("/")
        self._max_body = max_body
        self._idle: list[_Connection] = []
        self._heads: dict[tuple[object, ...], bytes] = {}

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> Reply:
        """One POST; wrap it in a timeout (a cancelled exchange closes its connection)."""
        data = b"".join(
            (
                self._head_of(path, headers),
                b"Content-Length: ",
                str(len(body)).encode("ascii"),
                b"\r\n\r\n",
                body,
            )
        )
        # A kept-alive connection without a coroutine to find it (the usual case).
        conn = self._kept_alive() or await self._connect()
        loop = asyncio.get_running_loop()
        done = False
        try:
            reply = await conn.begin(loop, data)
            done = True
            return reply
        except OSError as exc:
            raise UpstreamError(
                f"the connection failed after the call was sent: {_why(exc)}", sent=True
            ) from exc
        finally:
            if done and conn.reusable and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
            else:
                conn.close()

    def _head_of(self, path: str, headers: dict[str, str]) -> bytes:
        """The request line and header lines up to the length (CRLF after each): a
        forward sends the same few each time, so each is checked and encoded once
        (at most MAX_HEADS of them remembered)."""
        key = (path, *headers.items())
        head = self._heads.get(key)
        if head is None:
            lines = [
                b"POST " + (self._prefix + path).encode("ascii") + b" HTTP/1.1",
                b"Host: " + self._authority,
                *(_field(k) + b": " + _field(v) for k, v in headers.items()),
            ]
            head = b"".join(line + b"\r\n" for line in lines)
            if len(self._heads) < MAX_HEADS:
                self._heads[key] = head
        return head

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    def _kept_alive(self) -> _Connection | None:
        """An idle connection the server has not closed, if any (closing those it has)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.looks_open():
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        """A new connection."""
        if self._tls and self._context is None:
            self._context = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            transport, conn = await loop.create_connection(
                lambda: _Connection(self._max_body),
                self._host,
                self._port,
                ssl=self._context,
                server_hostname=self._host if self._tls else None,
            )
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamError(f"cannot connect: {_why(exc)}", sent=False) from exc
        # uvloop may call connection_made after create_connection has returned.
        conn.transport = transport
        with contextlib.suppress(OSError):
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn


def _why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
