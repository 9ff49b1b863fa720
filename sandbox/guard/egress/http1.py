"""Strict HTTP/1.1 for the egress proxy: h11's parser, and the checks a proxy adds.

h11 is lenient where a proxy must not be (bare LF, obs-fold, duplicate or
conflicting Content-Length, any `HTTP/x.y`); a proxy and the server behind it must
never read one byte stream as two requests (request smuggling), so each of these
is refused here: `head_end` checks the raw bytes, `check_request` the parsed head,
and `absolute_target`, `tunnel_target` and `check_host` where the request goes.
What is forwarded is rebuilt from the parsed head (`forward_headers`,
`request_head`), never relayed. A head without framing takes the line-matching
path (`http1_lines`); the rules for both paths are here.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

import h11

from sandbox.guard.egress import http1_lines

MAX_HEAD_BYTES = 64 * 1024  # one request or reply head; also h11's max_incomplete_event_size
MAX_HEADER_LINES = 100
VERSIONS = frozenset({b"1.0", b"1.1"})

# Never forwarded in either direction: they describe one hop, and the proxy frames
# each hop itself. (Content-Length and Transfer-Encoding are set from the parsed
# framing; Host is set from the judged target.)
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"te",
        b"trailer",
        b"upgrade",
        b"transfer-encoding",
        b"content-length",
        b"host",
        b"expect",
    }
)

# The three ambiguities of a head's line ends, found in one pass (a bare LF, a bare
# CR, a line that starts with whitespace: obs-fold); which one it is is told apart
# only once one is found.
_AMBIGUOUS = re.compile(rb"(?<!\r)\n|\r(?!\n)|\r\n[ \t]")
_CANONICAL_LENGTH = re.compile(rb"0|[1-9][0-9]{0,15}")
_HOST = r"(?P<host>[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\])"
_PORT = r"(?::(?P<port>[0-9]{1,5}))?"
_ORIGIN = r"(?P<origin>/[^#]*)"
_ABSOLUTE_HTTP = re.compile(rf"http://{_HOST}{_PORT}{_ORIGIN}?", re.IGNORECASE)
_ABSOLUTE_HTTPS = re.compile(rf"https://{_HOST}{_PORT}{_ORIGIN}?", re.IGNORECASE)
_AUTHORITY = re.compile(rf"{_HOST}:(?P<port>[0-9]{{1,5}})")
_HOST_HEADER = re.compile(rf"{_HOST}{_PORT}")


class Denied(Exception):
    """A request that is not forwarded, answered with a status and the reason: the parser
    refuses what cannot be forwarded as HTTP, the policy what it may not do. `stub`: a
    would-be effect, answered with the stub reply; otherwise a refusal, answered with an
    error. `unlogged`: the action log is full and has counted it already, so no line is
    tried."""

    def __init__(
        self, status: int, reason: str, *, stub: bool = False, unlogged: bool = False
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.stub = stub
        self.unlogged = unlogged


def head_end(buffer: bytes | bytearray) -> int | None:
    """Where the head in `buffer` ends (just past its blank line), or None when it is
    not complete yet. Raises Denied as soon as what has arrived is ambiguous."""
    end = buffer.find(b"\r\n\r\n")
    stop = end + 4 if end >= 0 else len(buffer)
    crlfs = buffer.count(b"\r\n", 0, stop)
    # A head whose every LF and every CR is part of a CRLF, and no CRLF of which is
    # followed by a space or a tab, holds none of the three: counted in C, without
    # the pattern's search at every byte (which tells them apart once one is there).
    if not (
        buffer.count(b"\n", 0, stop) == crlfs
        and buffer.count(b"\r", 0, stop) == crlfs
        and buffer.find(b"\r\n ", 0, stop) < 0
        and buffer.find(b"\r\n\t", 0, stop) < 0
    ):
        # An incomplete head may end in the CR of a CRLF still to come.
        found = _AMBIGUOUS.search(buffer, 0, stop)
        if found is not None and not (end < 0 and found.group() == b"\r" and found.end() == stop):
            if found.group() == b"\n":
                raise Denied(400, "a line of the request head ends in a bare LF")
            if found.group() == b"\r":
                raise Denied(400, "the request head holds a bare CR")
            raise Denied(400, "a header line starts with whitespace (obs-fold)")
    if stop > MAX_HEAD_BYTES:
        raise Denied(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes")
    if crlfs > MAX_HEADER_LINES + 2:
        raise Denied(431, f"the request head has more than {MAX_HEADER_LINES} header lines")
    return end + 4 if end >= 0 else None


def parse_request(head: bytes) -> tuple[h11.Connection | None, h11.Request]:
    """Parse one complete head (as `head_end` delimited it); the h11 connection that
    parsed it is returned to read the body with, None for a head without framing
    headers (no body: RFC 9112 6.3).

    Such a head (every read) is made by `http1_lines`; any other, and any that does
    not match h11's grammar there, is parsed by an h11 connection, whose refusal is
    the one reported. Both are checked by `check_request`."""
    request = http1_lines.plain_request(head)
    if request is not None:
        check_request(head, request)
        return None, request
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    conn.receive_data(head)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        status = exc.error_status_hint if exc.error_status_hint in (400, 431, 505) else 400
        raise Denied(status, f"malformed request head: {_clip(str(exc))}") from None
    if not isinstance(event, h11.Request):  # pragma: no cover - a complete head is a Request
        raise Denied(400, "malformed request head")
    check_request(head, event)
    return conn, event


def check_request(head: bytes, request: h11.Request) -> None:
    """What h11 let through that a proxy must not: raises Denied."""
    if request.method == b"PRI" and request.http_version == b"2.0":
        raise Denied(505, "an HTTP/2.0 prior-knowledge preface cannot be inspected; use HTTP/1.1")
    if request.http_version not in VERSIONS:
        version = request.http_version.decode("ascii", "replace")
        raise Denied(505, f"HTTP/{version} is not HTTP/1.1; it cannot be inspected")
    for _, name, _ in request.headers._full_items:  # a loop, not any() of a generator
        if name in http1_lines.FRAMING:
            break
    else:
        return  # no framing header in the parse: none in the head (h11 drops none)
    lengths: list[bytes] = []
    encodings = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.lower()
        if name == b"content-length":
            lengths.append(value.strip(b" \t"))
        elif name == b"transfer-encoding":
            encodings += 1
    if len(lengths) > 1:
        raise Denied(400, "the request has more than one Content-Length header")
    if lengths and not _CANONICAL_LENGTH.fullmatch(lengths[0]):
        raise Denied(400, "the request's Content-Length is not a plain decimal number")
    if lengths and encodings:
        raise Denied(400, "the request has both Content-Length and Transfer-Encoding")
    if encodings > 1:
        raise Denied(400, "the request has more than one Transfer-Encoding header")


def fields(message: h11.Request | h11.Response) -> dict[bytes, bytes]:
    """The message's headers by lower-case name, each name's first value (h11-normalised).

    Made once per message and looked up many times: h11's `headers` is a Sequence
    whose iteration calls a Python `__getitem__` per item (and raises IndexError at
    the end), which per lookup cost more than the whole index. (This module reads
    h11's own list of (name, lower-case name, value), `_full_items`, so that no name
    is lower-cased twice.)"""
    found: dict[bytes, bytes] = {}
    for _, name, value in message.headers._full_items:
        if name not in found:
            found[name] = value
    return found


def body_length(found: dict[bytes, bytes]) -> int | None:
    """A request's Content-Length from its `fields`; None when it is chunked."""
    if b"transfer-encoding" in found:
        return None
    return int(found.get(b"content-length") or b"0")


@dataclass(frozen=True)
class Target:
    """Where a request goes: the judged host and port, and the origin-form target."""

    host: str
    port: int
    origin: str

    def authority(self, default_port: int) -> str:
        """host[:port] as a Host header or URL names it (the port only when not the default)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default_port else f"{host}:{self.port}"

    def url(self, scheme: str) -> str:
        return f"{scheme}://{self.authority(443 if scheme == 'https' else 80)}{self.origin}"


def _host_port(match: re.Match[str], default_port: int) -> tuple[str, int]:
    host = match.group("host").lower().strip("[]")
    port = int(match.group("port") or default_port)
    if not 0 < port < 65536:
        raise Denied(400, f"port {port} is out of range")
    return host.rstrip("."), port


# A parse of a short target or Host value is remembered (a step asks for the same
# few URLs and names the same host again and again; each answer is a pure function of
# its input; a refusal raised is not remembered): at most MEMO entries of at most
# MEMO_BYTES each, whatever the step sends.
MEMO = 256
MEMO_BYTES = 256


def absolute_target(target: bytes) -> Target:
    """A proxy request's target: exactly `http://host[:port][/path[?query]]`."""
    if len(target) <= MEMO_BYTES:
        return _remembered_target(target)
    return _absolute_target(target)


def _absolute_target(target: bytes) -> Target:
    text = target.decode("ascii")
    match = _ABSOLUTE_HTTP.fullmatch(text)
    if match is None:
        authority = text.partition("://")[2].partition("/")[0]
        if "@" in authority:
            raise Denied(400, "the request target carries userinfo (user@host)")
        raise Denied(400, "a proxy request needs an absolute http://host/path target")
    host, port = _host_port(match, 80)
    return Target(host, port, match.group("origin") or "/")


_remembered_target = functools.lru_cache(maxsize=MEMO)(_absolute_target)


def tunnel_target(target: bytes, host: str, port: int) -> Target:
    """A request's target inside a tunnel to host:port: origin form, or the absolute
    `https://` URL of that same host and port."""
    text = target.decode("ascii")
    if text.startswith("/"):
        if "#" in text:
            raise Denied(400, "the request target carries a fragment")
        return Target(host, port, text)
    match = _ABSOLUTE_HTTPS.fullmatch(text)
    if match is None:
        raise Denied(400, "inside a tunnel the request target must be a path (/...)")
    named = _host_port(match, 443)
    if named != (host, port):
        raise Denied(400, f"the request target names {named[0]}:{named[1]}, not the tunnel's host")
    return Target(host, port, match.group("origin") or "/")


def connect_target(target: bytes) -> tuple[str, int]:
    """A CONNECT's target: exactly `host:port`."""
    match = _AUTHORITY.fullmatch(target.decode("ascii"))
    if match is None:
        raise Denied(400, "CONNECT needs a host:port target")
    return _host_port(match, 0)


def check_host(
    request: h11.Request, found: dict[bytes, bytes], host: str, port: int, default_port: int
) -> None:
    """A Host header, when there is one, names exactly the judged host and port.
    `found`: the request's `fields`."""
    value = found.get(b"host")
    if value is None:
        if request.http_version == b"1.1":  # h11 requires it already
            raise Denied(400, "an HTTP/1.1 request needs a Host header")
        return
    judged = (
        _remembered_host(value, default_port)
        if len(value) <= MEMO_BYTES
        else _host_named(value, default_port)
    )
    if judged != (host, port):
        shown = _clip(value.decode("latin-1"), 100)
        raise Denied(400, f"the Host header ({shown}) disagrees with the request's target")


def _host_named(value: bytes, default_port: int) -> tuple[str, int] | None:
    """The host and port a Host header's value names; None when it is not a host[:port]."""
    match = _HOST_HEADER.fullmatch(value.decode("latin-1"))
    return None if match is None else _host_port(match, default_port)


_remembered_host = functools.lru_cache(maxsize=MEMO)(_host_named)


def connection_tokens(
    message: h11.Request | h11.Response | h11.InformationalResponse,
) -> set[bytes]:
    # a loop, not a set of a generator: called for every request and every reply
    tokens: set[bytes] = set()
    for _, name, value in message.headers._full_items:
        if name == b"connection":
            for token in value.split(b","):
                tokens.add(token.strip().lower())
    return tokens


def forward_headers(
    message: h11.Request | h11.Response | h11.InformationalResponse,
    *,
    keep: Iterable[bytes] = (),
    tokens: set[bytes] | None = None,
) -> list[tuple[bytes, bytes]]:
    """The message's end-to-end headers, in order and in the sender's spelling: every
    hop-by-hop header and every header its Connection header names is dropped, except
    the framing headers listed in `keep`. `tokens`: its `connection_tokens`."""
    named = connection_tokens(message) if tokens is None else tokens
    kept = frozenset(keep)
    return [
        (raw, value)
        for raw, name, value in message.headers._full_items
        if name in kept or (name not in HOP_BY_HOP and name not in named)
    ]


def request_head(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """An HTTP/1.1 request head as h11 writes it: the request line, the Host header
    first, then every other header in order; None when `headers` frame a body
    (Content-Length, Transfer-Encoding: h11 writes that request, and frames its body).
    `headers` must be valid already (parsed by h11, or the proxy's own)."""
    hosts = [b"%s %s HTTP/1.1\r\n" % (method, target)]
    rest = []
    for item in headers:  # one pass, each name lower-cased once
        name = item[0].lower()
        if name == b"host":
            hosts.append(b"%s: %s\r\n" % item)
        elif name in http1_lines.FRAMING:
            return None
        else:
            rest.append(b"%s: %s\r\n" % item)
    hosts += rest
    hosts.append(b"\r\n")
    return b"".join(hosts)


def wants_keep_alive(request: h11.Request) -> bool:
    """HTTP/1.1 without `Connection: close`."""
    return request.http_version == b"1.1" and b"close" not in connection_tokens(request)


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def upgrade_tokens(request: h11.Request) -> list[bytes]:
    """The protocols the request's Upgrade headers (all of them) ask for, lower-case,
    without versions."""
    tokens: list[bytes] = []
    for _, name, value in request.headers._full_items:
        if name == b"upgrade":
            tokens += [t.strip().split(b"/")[0].lower() for t in value.split(b",") if t.strip()]
    return tokens
