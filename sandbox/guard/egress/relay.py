"""The reply relay: the upstream's reply head parsed and rebuilt, its body streamed.

Hop-by-hop headers are dropped, Content-Length or chunked is set from the parsed
framing, and `Connection: close` is sent whenever the proxy will close, so a client
that reuses its connection can trust where each reply ends. A Content-Length or
close-delimited body of a plain HTTP reply moves with `splice(2)`, past Python.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, NamedTuple

import h11

from sandbox.guard.egress import http1, http1_lines, splice
from sandbox.guard.egress.connection import CHUNK, Client
from sandbox.guard.egress.http1 import Denied
from sandbox.guard.egress.pool import Upstream

SMALL_READ = 64 * 1024  # a reply head's read (a head is at most 64 KiB too)
SPLICE_MIN_BYTES = 64 * 1024  # a smaller rest of a body is cheaper to copy than to splice


class Sent(NamedTuple):
    """The request as forwarded: method, origin-form target and headers (Host first).
    (A tuple: one per request, made without a frozen dataclass's setattr per field.)"""

    method: bytes
    origin: bytes
    headers: list[tuple[bytes, bytes]]


def request_head(sent: Sent) -> tuple[h11.Connection | None, bytes]:
    """The forwarded request's head, and the h11 connection that writes its body and
    reads its reply (None: there is no body, and the reply is read without h11 while
    it can be; see `relay_reply`).

    A request without framing headers (every read) is written here, byte for byte as
    h11 writes it (request line, Host first, then the rest in order:
    tests/guard/egress/test_http1.py pins that). Nothing in it needs h11's validation again: the
    method, the target's path and every client header came out of h11's grammar
    (`http1.parse_request`), and Host and Connection are the proxy's own, built from
    the judged target. A request with a body (a model call's Content-Length or
    chunked framing) goes through h11 whole, so that h11 frames the body it writes."""
    head = http1.request_head(sent.method, sent.origin, sent.headers)
    if head is not None:
        return None, head
    outgoing = new_outgoing()
    head = outgoing.send(h11.Request(method=sent.method, target=sent.origin, headers=sent.headers))
    assert head is not None
    return outgoing, head


def new_outgoing() -> h11.Connection:
    return h11.Connection(h11.CLIENT, max_incomplete_event_size=http1.MAX_HEAD_BYTES)


def h11_outgoing(sent: Sent) -> h11.Connection:
    """An h11 connection told about a body-less request that went out already (what
    frames its reply: method, target, Host, Connection), ready to read the reply."""
    outgoing = new_outgoing()
    framing = [(n, v) for n, v in sent.headers if n.lower() in (b"host", b"connection")]
    outgoing.send(h11.Request(method=sent.method, target=sent.origin, headers=framing))
    outgoing.send(h11.EndOfMessage())
    return outgoing


def framing_of(method: bytes, status: int, found: dict[bytes, bytes]) -> tuple[str, int]:
    """How a reply's body is framed ("none", "chunked", "length", "close"), and its
    length when counted. `found`: the reply's `fields`."""
    if method == b"HEAD" or status in (204, 304):
        return "none", 0
    if b"transfer-encoding" in found:
        return "chunked", 0
    if (declared := found.get(b"content-length")) is not None:
        return "length", int(declared)
    return "close", 0


async def reply_head(upstream: Upstream, outgoing: h11.Connection) -> h11.Response:
    """The upstream's final reply head, as h11 parses it (informational replies skipped)."""
    event = await head_event(upstream, outgoing, switch=False)
    assert isinstance(event, h11.Response)  # a 101 is returned only with `switch`
    return event


async def head_event(
    upstream: Upstream, outgoing: h11.Connection, *, switch: bool
) -> h11.Response | h11.InformationalResponse:
    """The upstream's final reply head; `switch`: a 101 (an upgrade's answer) too."""
    while True:
        try:
            event = outgoing.next_event()
        except h11.RemoteProtocolError as exc:
            raise Denied(502, f"the host sent a malformed reply: {exc}") from None
        if event is h11.NEED_DATA:
            outgoing.receive_data(await upstream.recv())
        elif isinstance(event, h11.Response):
            return event
        elif isinstance(event, h11.InformationalResponse):
            if switch and event.status_code == 101:
                return event
        else:
            raise Denied(502, "the host closed the connection without a reply")


async def relay_counted(
    client: Client, upstream: Upstream, outgoing: h11.Connection, head: bytes, length: int | None
) -> bool:
    """The reply head, then a body of `length` bytes (None: up to the upstream's close);
    True when all of it arrived. What h11 already holds goes out with the head; the rest
    is spliced when both ends are plain TCP."""
    sent = 0
    pending = bytearray(head)
    while length is None or sent < length:
        try:
            event = outgoing.next_event()
        except h11.RemoteProtocolError:
            break
        if not isinstance(event, h11.Data):
            break
        pending += event.data
        sent += len(event.data)
    await client.write(bytes(pending))
    remaining = None if length is None else length - sent
    if remaining == 0:
        return True
    if client.tap is not None and remaining is not None and remaining > SPLICE_MIN_BYTES:
        client.tap.rest_unseen(remaining)  # past a cap: spliced, not kept
    target = client.splice_socket()
    small = remaining is not None and remaining <= SPLICE_MIN_BYTES
    if upstream.sock is not None and target is not None and not small:
        moved = await splice.relay(upstream.sock, target, remaining)
        return remaining is not None and moved == remaining
    while remaining is None or remaining > 0:
        data = await upstream.recv()
        if not data:
            return remaining is None
        if remaining is not None:
            if len(data) > remaining:
                upstream.overread = True
            data = data[:remaining]
            remaining -= len(data)
        await client.write(data)
    return True


async def relay_chunked(
    client: Client, upstream: Upstream, outgoing: h11.Connection, head: bytes, *, chunked: bool
) -> None:
    """The reply head, then a chunked body, decoded by h11 and framed again by the proxy
    (trailers dropped); `chunked` False writes it plain, for an HTTP/1.0 client that
    reads to the close."""
    await client.write(head)
    while True:
        try:
            event = outgoing.next_event()
        except h11.RemoteProtocolError as exc:
            raise ConnectionError(f"malformed chunked reply: {exc}") from None
        if event is h11.NEED_DATA:
            outgoing.receive_data(await upstream.recv())
        elif isinstance(event, h11.Data):
            if event.data:
                data = bytes(event.data)
                await client.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        elif isinstance(event, h11.EndOfMessage):
            if chunked:
                await client.write(b"0\r\n\r\n")
            return
        else:
            raise ConnectionError("the chunked reply ended early")


async def pump_up(client: Client, upstream: Upstream) -> None:
    try:
        while data := await client.reader.read(CHUNK):
            await upstream.send(data)
    except (ConnectionError, OSError):
        pass
    finally:
        upstream.shutdown_write()


async def pump_down(upstream: Upstream, client: Client) -> None:
    target = client.splice_socket()
    try:
        if upstream.sock is not None and target is not None:
            await splice.relay(upstream.sock, target)
        else:
            while data := await upstream.recv():
                await client.write(data)
    except (ConnectionError, OSError, TimeoutError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if client.writer.can_write_eof():
                client.writer.write_eof()


async def relay_reply(
    client: Client,
    upstream: Upstream,
    outgoing: h11.Connection | None,
    sent: Sent,
    request: h11.Request,
    outcome: dict[str, Any],
) -> bool:
    """Relay the reply; `outcome` gets its status (and `reply_cut` when the upstream
    ended the body early). Whether the client's connection carries another request.

    `outgoing` None (a request without a body, written by the proxy): the reply
    head is parsed here with h11's grammar (`http1_lines.parse_reply`) when its first read
    holds all of it; a reply with no body, or with a Content-Length body of at most
    SPLICE_MIN_BYTES past what came with the head (a small reply, read whole
    here), is relayed from there in one write. Any other reply (a head split
    across reads, a large body, chunked, to the close, informational, cut short,
    or one the grammar does not take) goes to an h11 connection that is told the
    request and given every byte read so far, and is relayed by h11."""
    raw = b""
    parsed: tuple[h11.Response, bytes] | None = None
    if outgoing is None:
        # at most a head and a small body: a buffer below malloc's mmap threshold
        raw = await upstream.recv(SMALL_READ)
        parsed = http1_lines.parse_reply(raw)
    if parsed is not None:
        response, rest = parsed
        found = http1.fields(response)
        framing, length = framing_of(request.method, response.status_code, found)
        # A small body's rest (its head and body may come in two sends) is read
        # here; a large one is relayed by h11 and splice.
        while framing == "length" and len(rest) < length <= len(rest) + SPLICE_MIN_BYTES:
            more = await upstream.recv(SMALL_READ)
            if not more:
                break  # cut short: h11's relay below says so
            raw += more
            rest += more
        if not (framing == "none" or (framing == "length" and len(rest) >= length)):
            parsed = None  # not all here, or not counted: h11 gets every byte read
    if parsed is None:
        if outgoing is None:
            outgoing = h11_outgoing(sent)
            outgoing.receive_data(raw)  # b"": the host closed, which h11 then says
        response, rest = await reply_head(upstream, outgoing), b""
        found = http1.fields(response)
        framing, length = framing_of(request.method, response.status_code, found)
    status = response.status_code
    outcome["status"] = status
    tokens = http1.connection_tokens(response)
    client_11 = request.http_version == b"1.1"
    keep = http1.wants_keep_alive(request) and framing != "close"
    headers = http1.forward_headers(response, tokens=tokens)
    if framing == "length":
        headers.append((b"Content-Length", b"%d" % length))
    elif framing == "chunked" and client_11:
        headers.append((b"Transfer-Encoding", b"chunked"))
    elif framing == "chunked":
        keep = False  # an HTTP/1.0 client: the body runs to the close
    elif framing == "none" and status != 204:
        declared = found.get(b"content-length")
        if declared is not None:
            headers.append((b"Content-Length", declared))
    if not keep:
        headers.append((b"Connection", b"close"))
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, response.reason)]
    lines += [b"%s: %s\r\n" % item for item in headers]
    lines.append(b"\r\n")
    client.replying = True
    complete = True
    after = b""  # what came after the reply (a reply relayed without h11)
    if outgoing is None:
        # the head and a small body in one buffer, the body copied once
        lines.append(rest[:length])
        after = rest[length:]
        await client.write(b"".join(lines))
    elif framing == "none":
        await client.write(b"".join(lines))
    elif framing == "chunked":
        head = b"".join(lines)
        await relay_chunked(client, upstream, outgoing, head, chunked=client_11)
    else:
        head = b"".join(lines)
        complete = await relay_counted(
            client, upstream, outgoing, head, length if framing == "length" else None
        )
        if not complete:
            outcome["reply_cut"] = True
        keep = keep and complete
    if outgoing is not None:
        after = outgoing.trailing_data[0]
    client.replying = False
    # The upstream connection may carry the next request only when this reply ended
    # exactly where its framing said and nothing came after it.
    upstream.reusable = (
        complete
        and framing != "close"
        and response.http_version == b"1.1"
        and b"close" not in tokens
        and not upstream.overread
        and not after
    )
    return keep


async def relay_both_ways(client: Client, upstream: Upstream) -> None:
    """Relay bytes both ways until either side ends: what the client sent ahead goes
    first. Used for a blind tunnel and an opted-in WebSocket, never judged inside."""
    client.replying = True
    early, client.buffer = bytes(client.buffer), bytearray()
    await upstream.send(early)
    await asyncio.gather(pump_up(client, upstream), pump_down(upstream, client))


async def relay_upgrade(
    client: Client, upstream: Upstream, sent: Sent, outcome: dict[str, Any]
) -> None:
    """An opted-in WebSocket: the host's 101 goes to the step and the connection becomes
    a two-way relay; any other reply (the host declined) is relayed and ends it."""
    conn = new_outgoing()
    conn.send(h11.Request(method=sent.method, target=sent.origin, headers=sent.headers))
    conn.send(h11.EndOfMessage())
    event = await head_event(upstream, conn, switch=True)
    if isinstance(event, h11.Response):
        outcome["status"] = event.status_code
        await _relay_final(client, upstream, conn, event)
        return
    outcome["status"] = 101
    switched = http1.forward_headers(event, keep=(b"upgrade", b"connection"))
    head = b"HTTP/1.1 101 %s\r\n" % (event.reason or b"Switching Protocols")
    head += b"".join(name + b": " + value + b"\r\n" for name, value in switched) + b"\r\n"
    client.replying = True
    await client.write(head + conn.trailing_data[0])
    await relay_both_ways(client, upstream)


async def _relay_final(
    client: Client, upstream: Upstream, conn: h11.Connection, response: h11.Response
) -> None:
    """A final reply to an upgrade request, relayed with `Connection: close`."""
    found = http1.fields(response)
    framing, length = framing_of(b"GET", response.status_code, found)
    headers = http1.forward_headers(response)
    if framing == "length":
        headers.append((b"Content-Length", b"%d" % length))
    elif framing == "chunked":
        headers.append((b"Transfer-Encoding", b"chunked"))
    headers.append((b"Connection", b"close"))
    head = b"HTTP/1.1 %d %s\r\n" % (response.status_code, response.reason)
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers) + b"\r\n"
    client.replying = True
    if framing == "chunked":
        await relay_chunked(client, upstream, conn, head, chunked=True)
    elif framing == "none":
        await client.write(head)
    else:
        await relay_counted(client, upstream, conn, head, length if framing == "length" else None)
