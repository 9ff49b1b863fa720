"""A request to the egress proxy: its head read and parsed (`http1`), the allow-list
entry that admits its host, and whether a request may pass as a read.

The policy of a request is applied here and nowhere else, as `sandbox.policy.http_kind`
decides it: GET and HEAD without a body pass to an allow-listed host, and so does
git's smart-HTTP fetch (`git-upload-pack`) with its body; a `model` entry passes any
method; anything else is a denial (`Denied`), stubbed or refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11

from sandbox import policy
from sandbox.contracts.guardparts import Egress, EgressEntry
from sandbox.guard.egress import http1
from sandbox.guard.egress.connection import Client
from sandbox.guard.egress.http1 import Denied
from sandbox.policy import HttpKind

MAX_HASHED_BODY_BYTES = 16 * 1024 * 1024

# The client's next bytes (b"" at its end); `idle`: between requests.
Fill = Callable[..., Awaitable[bytes]]


def match(egress: Egress, host: str, port: int, *, tunnel: bool) -> EgressEntry | None:
    """The allow-list entry that admits host:port, if any (wildcards match subdomains only).

    `tunnel` is a CONNECT: it needs port 443 or an entry whose explicit port is marked
    `tls`; plain HTTP needs port 80 or an entry's explicit non-TLS port."""
    host = host.lower().rstrip(".")
    for entry in egress.allow:
        pattern = entry.host.strip("[]")
        if pattern.startswith("*."):
            ok = host.endswith(pattern[1:]) and host != pattern[2:]
        else:
            ok = host == pattern
        if not ok:
            continue
        if entry.port is None:
            if port == (443 if tunnel else 80):
                return entry
        elif entry.port == port and entry.tls == tunnel:
            return entry
    return None


@dataclass
class Seen:
    """What the log says a request was."""

    method: str = ""
    url: str = ""
    host: str = ""
    tls: str = ""  # "inspected" | "method not seen" | "" (plain HTTP)
    connection: int = 0  # which of the step's connections to this proxy carried it
    forwarded: bool = False  # its start line is written and its bytes went out
    aliases: dict[str, Any] = field(default_factory=dict)  # `sandbox.guard.egress.aliases`
    via: str = "proxy"  # how the step reached the guard: "proxy" | "direct" (redirected)
    destination: str = ""  # a redirected connection's original address:port
    upgrade: str = ""  # the protocol an Upgrade header asked for
    websocket: bool = False  # an opted-in WebSocket: every line of its connection says so
    git: str = ""  # git's smart HTTP: "upload-pack" (a fetch) or "receive-pack" (a push)


@dataclass
class Incoming:
    """One parsed request and the h11 connection that reads its body; `fields` its
    headers by name, indexed once (every check looks them up)."""

    conn: h11.Connection | None  # None: a head without framing headers (no body)
    request: h11.Request
    head: bytes
    fields: dict[bytes, bytes] = field(init=False)
    # No Transfer-Encoding and no Content-Length other than 0: the head is the whole
    # request (RFC 9112 6.3), so its body is not read through h11 and the bytes after
    # the head stay in the client's buffer as the next request's.
    bodyless: bool = field(init=False)

    def __post_init__(self) -> None:
        self.fields = http1.fields(self.request)
        self.bodyless = http1.body_length(self.fields) == 0

    @property
    def method(self) -> bytes:
        return self.request.method


async def next_request(client: Client, fill: Fill) -> Incoming | None:
    """The next request's head, checked and parsed; None when the client is done."""
    while True:
        # nothing buffered (a connection's first read, and most requests' on a kept
        # connection): nothing to look for a head in yet
        end = http1.head_end(client.buffer) if client.buffer else None
        if end is not None:
            break
        idle = not client.buffer
        try:
            data = await fill(client, idle=idle)
        except TimeoutError:
            if idle:
                return None
            raise Denied(408, "the request head stopped arriving") from None
        if not data:
            if client.buffer:
                raise Denied(400, "the connection closed in the middle of a request head")
            return None
        client.buffer += data
    head = bytes(client.buffer[:end])
    conn, request = http1.parse_request(head)  # a refusal leaves the head for the log
    incoming = Incoming(conn, request, head)
    del client.buffer[:end]  # what follows a body-less head is the next request's
    if client.buffer and conn is not None and not incoming.bodyless:
        # h11 takes b"" for the client's end: a body still on its way is not that
        conn.receive_data(bytes(client.buffer))
        client.buffer.clear()
    return incoming


async def read_body(client: Client, incoming: Incoming, fill: Fill) -> AsyncIterator[bytes]:
    """The request's body as h11 decodes it; what follows it stays in the buffer."""
    conn = incoming.conn
    if incoming.bodyless or conn is None:
        return
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise Denied(400, f"malformed request body: {exc}") from None
        if event is h11.NEED_DATA:
            conn.receive_data(await fill(client, idle=False))
        elif isinstance(event, h11.Data):
            yield bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            break
        else:
            raise Denied(400, "the request body ended early")
    client.buffer += conn.trailing_data[0]


async def body_facts(client: Client, incoming: Incoming | None, fill: Fill) -> dict[str, Any]:
    """Size and hash of a denied request's body (read, never forwarded, never logged)."""
    if incoming is None:
        return {}
    if b"100-continue" in incoming.fields.get(b"expect", b""):
        return {"body_bytes": None, "body_note": "not sent: the client waited for 100"}
    digest = hashlib.sha256()
    size = 0
    try:
        async for chunk in read_body(client, incoming, fill):
            digest.update(chunk)
            size += len(chunk)
            if size > MAX_HASHED_BODY_BYTES:
                return {"body_bytes": size, "body_sha256": None, "body_truncated": True}
    except (Denied, TimeoutError, ConnectionError):
        return {"body_bytes": size, "body_sha256": None, "body_truncated": True}
    return {"body_bytes": size, "body_sha256": digest.hexdigest()}


def judge_read(incoming: Incoming, entry: EgressEntry, origin: str, seen: Seen) -> bool:
    """Raise unless an allow-listed request may pass (`sandbox.policy.http_kind`): a
    model endpoint takes any method; git's fetch passes with its body; anything else
    passes only as GET or HEAD without a body. True when the request's body is
    forwarded (a model call or a git fetch)."""
    if entry.model:
        return True
    method = incoming.method.decode("ascii")
    content_type = incoming.fields.get(b"content-type", b"").decode("latin-1")
    kind = policy.http_kind(method, origin, content_type)
    if kind is HttpKind.GIT_FETCH:
        seen.git = "upload-pack"
        return True
    if kind is not HttpKind.READ:
        if kind is HttpKind.GIT_PUSH:
            seen.git = "receive-pack"
        raise Denied(403, policy.http_effect_reason(kind, method), stub=True)
    if b"transfer-encoding" in incoming.fields:
        raise Denied(400, "Transfer-Encoding on a read is ambiguous; it is not forwarded")
    if http1.body_length(incoming.fields):
        raise Denied(
            403, "a read (GET or HEAD) carries no body; one that does is not forwarded", stub=True
        )
    return False


def upgrade_asked(incoming: Incoming, seen: Seen) -> bool:
    """Whether the request asks for a WebSocket. HTTP/2 in cleartext (h2c) and any other
    upgrade are refused: what follows the switch is not HTTP/1.1 and cannot be judged."""
    tokens = http1.upgrade_tokens(incoming.request)
    if not tokens:
        return False
    seen.upgrade = b", ".join(tokens).decode("ascii", "replace")[:100]
    if b"h2c" in tokens:
        raise Denied(403, "an h2c upgrade (HTTP/2 in cleartext) cannot be inspected; use HTTP/1.1")
    if tokens != [b"websocket"]:
        raise Denied(403, f"a protocol upgrade ({seen.upgrade}) cannot be inspected")
    return True


def judge_websocket(incoming: Incoming, entry: EgressEntry, seen: Seen) -> None:
    """Raise unless the host's allow entry opts in to WebSockets (`websocket = true`):
    the channel carries both ways what no method filter can judge, so it is stubbed."""
    if not entry.websocket:
        raise Denied(
            403,
            "a WebSocket is a two-way channel a method filter cannot judge;"
            " the host's allow entry does not opt in (websocket = true)",
            stub=True,
        )
    if incoming.method != b"GET" or not incoming.bodyless:
        raise Denied(400, "a WebSocket upgrade is a GET without a body")
    seen.websocket = True
