"""What the egress proxy writes about a request: the action-log line's facts, and the
reply that answers a denial.

Every egress line is made by `facts`, so a line through the proxy and one that
came straight (`via: direct`) say the same things the same way. A denial's reply is
the stub text for a would-be effect and an error text for anything else, never
"continue as if it succeeded".
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any

from sandbox.guard.actionline import REDACTED, SECRET_WORDS
from sandbox.guard.egress.http1 import Denied
from sandbox.guard.egress.request import Seen
from sandbox.guard.memo import remember
from sandbox.policy import stub_reply

# Header values never written to the log (the step's credentials for real hosts).
SECRET_HEADER = re.compile(SECRET_WORDS.encode(), re.IGNORECASE)
REASON_PHRASES = {
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    501: "Not Implemented",
    502: "Bad Gateway",
    505: "HTTP Version Not Supported",
}


def facts(
    seen: Seen,
    label: dict[str, object],
    active: list[str],
    *,
    status: int | None,
    body: dict[str, Any] | None = None,
    extra_detail: dict[str, Any] | None = None,
    extra_arguments: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A line's arguments (method, URL, body facts, forwarded head) and detail (whose
    proxy, host, the step's connection it came on, status, TLS, calls in flight)."""
    arguments: dict[str, Any] = {"method": seen.method, "url": seen.url}
    arguments.update(body or {})
    arguments.update(extra_arguments or {})
    detail: dict[str, Any] = {**label, "host": seen.host, "connection": seen.connection}
    detail.update(seen.aliases)
    detail["via"] = seen.via
    if seen.destination:
        detail["destination"] = seen.destination
    if status is not None:
        detail["status"] = status
    if seen.tls:
        detail["tls"] = seen.tls
    if seen.upgrade:
        detail["upgrade"] = seen.upgrade
    if seen.websocket:
        detail["websocket"] = True
    if seen.git:
        detail["git"] = seen.git
    detail.update(extra_detail or {})
    if active:
        detail["active_tool_calls"] = active
    return arguments, detail


def error_reply(denied: Denied, seen: Seen) -> bytes:
    """A denial as HTTP: the stub reply for a stub, an error text for anything else
    (never "continue as if it succeeded"); the proxy closes after it."""
    label = f"HTTP {seen.method}" if seen.method else "HTTP request"
    if denied.stub:
        text, mark = stub_reply(label, denied.reason), b"stubbed"
    elif seen.forwarded:
        text, mark = f"TEST MODE: {label} was sent but failed ({denied.reason}).", b"error"
    else:
        text, mark = (
            f"TEST MODE: {label} was refused ({denied.reason}); nothing was sent.",
            b"refused",
        )
    payload = (text + "\n").encode()
    phrase = REASON_PHRASES.get(denied.status, "Error").encode()
    return (
        b"HTTP/1.1 %d %s\r\n" % (denied.status, phrase)
        + b"Content-Type: text/plain; charset=utf-8\r\n"
        + b"Content-Length: %d\r\n" % len(payload)
        + b"X-Agentworks-Test-Mode: "
        + mark
        + b"\r\nConnection: close\r\n\r\n"
        + payload
    )


def failure(exc: BaseException) -> str:
    """How a forwarded exchange failed, for its outcome line."""
    if isinstance(exc, Denied):
        return exc.reason
    return f"{type(exc).__name__}: {exc}"[:300]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# A forwarded head's hash and its lines as shown, remembered by its bytes (a pure
# function of them): a read asked again is rebuilt into the same head. At most
# MEMO_HEADS heads of at most MEMO_HEAD_BYTES each, whatever the step sends.
MEMO_HEADS = 256
MEMO_HEAD_BYTES = 2048
_HEADS: dict[bytes, tuple[str, tuple[str, ...]]] = {}


def head_facts(head: bytes) -> tuple[str, tuple[str, ...]]:
    """A forwarded head's SHA-256 (`sha`) and its lines as shown (`shown_head`), the
    same head's remembered (MEMO_HEADS)."""
    found = _HEADS.get(head)
    if found is None:
        found = (sha(head), tuple(shown_head(head)))
        remember(_HEADS, head, found, entries=MEMO_HEADS, longest=MEMO_HEAD_BYTES)
    return found


def shown_head(head: bytes) -> list[str]:
    """The forwarded head as log lines, credentials masked (the hash covers the bytes)."""
    lines = head.split(b"\r\n")[:-2]
    shown = [lines[0].decode("latin-1")]
    for line in lines[1:]:
        name, _, value = line.partition(b": ")
        masked = _REDACTED if _secret_name(name) else value
        shown.append((name + b": " + masked).decode("latin-1"))
    return shown


_REDACTED = REDACTED.encode()


@functools.lru_cache(maxsize=1024)
def _short_secret_name(name: bytes) -> bool:
    return SECRET_HEADER.search(name) is not None


def _secret_name(name: bytes) -> bool:
    """Whether a header's name marks a credential. The same names come in every
    request, so a short name's answer is remembered (at most 1,024 names of at most 64
    bytes: the step cannot make the memo cost memory); a longer one is searched each time."""
    if len(name) <= 64:
        return _short_secret_name(name)
    return SECRET_HEADER.search(name) is not None
