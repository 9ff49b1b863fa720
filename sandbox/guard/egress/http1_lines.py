"""A request or reply head matched line by line with h11's own grammar, made into
h11's own event without an h11 connection (`http1`'s second path for the same heads).

A read's request head and a small reply head that arrived whole are the proxy's
every request; an h11 connection and its state machine cost more per request than
the rest of the parse, so these heads are matched here with the patterns h11's
readers use and made into events the way h11's reader makes them (`_parsed`). Any
head this module does not take (a line the grammar refuses, framing headers, an
informational reply) returns None and goes to h11 whole, which refuses it in its
own words. tests/guard/egress/test_http1_lines.py runs the same valid and hostile
heads through both paths. A line the grammar matched is remembered by its bytes (a
pure function of them, bounded: `MEMO_LINES`), so a line seen before is not matched
again, and so is a whole head made into its event (`MEMO_HEADS`); a line or head it
refused is matched each time.
"""

from __future__ import annotations

import re
from typing import Any

import h11
from h11 import _headers as h11_headers
from h11 import _readers as h11_readers

from sandbox.guard.memo import remember

# h11's own grammar for a request line, a status line and a header field (the
# patterns its readers match each line with), so that a head parsed here is accepted
# exactly when h11 would accept it.
_H11_REQUEST_LINE: re.Pattern[bytes] = h11_readers.request_line_re
_H11_STATUS_LINE: re.Pattern[bytes] = h11_readers.status_line_re
_H11_FIELD: re.Pattern[bytes] = h11_readers.header_field_re
# The headers that frame a body: a head with one goes to h11 whole (`http1` asks too).
FRAMING = frozenset({b"content-length", b"transfer-encoding"})
_MAX_LENGTH_DIGITS = h11_headers.CONTENT_LENGTH_MAX_DIGITS


# A line's match, remembered: the groups h11's pattern gave a line it accepted, keyed
# by the line's bytes (a pure function of them; a line the pattern refuses is matched
# again each time). The same lines come in request after request (a Host, a status
# line, a Server header), and a match is most of a line's cost; at most MEMO_LINES
# lines of at most MEMO_LINE_BYTES each per pattern, whatever the step or a host sends.
MEMO_LINES = 512
MEMO_LINE_BYTES = 256
Groups = tuple[Any, ...]  # bytes, None for an optional group not there (a reason)
Item = tuple[bytes, bytes, bytes]
_FIELDS: dict[bytes, Item] = {}
_FIRST_LINES: dict[re.Pattern[bytes], dict[bytes, Groups]] = {}

# A whole head's event, remembered the same way: a request head made into h11's
# `Request` (by the head's bytes) and a reply head made into its `Response` (by the
# head's bytes without its blank line). Events are frozen and a pure function of
# those bytes; a head this module does not take is not remembered (h11 reads it, and
# refuses it, each time). A kept-alive read repeats its head byte for byte, and a
# host's reply head repeats until its Date changes. At most MEMO_HEADS heads of at
# most MEMO_HEAD_BYTES each per direction (with their events, about 3 MiB at the
# worst: heads of many short lines, none shared).
MEMO_HEADS = 64
MEMO_HEAD_BYTES = 2048
_REQUESTS: dict[bytes, h11.Request] = {}
_REPLIES: dict[bytes, h11.Response] = {}


def _first_line(line: bytes, pattern: re.Pattern[bytes]) -> Groups | None:
    """`pattern`'s named groups in a head's first line (in their order in the
    pattern), None when it does not match."""
    memo = _FIRST_LINES.setdefault(pattern, {})
    found = memo.get(line)
    if found is None:
        match = pattern.fullmatch(line)
        if match is None:
            return None
        found = match.group(*pattern.groupindex)
        remember(memo, line, found, entries=MEMO_LINES, longest=MEMO_LINE_BYTES)
    return found


def _field(line: bytes) -> Item | None:
    """A header line as h11's `Headers` keeps it (name, lower-case name, value) when
    h11's header-field rule matches it; None when it does not."""
    found = _FIELDS.get(line)
    if found is None:
        match = _H11_FIELD.fullmatch(line)
        if match is None:
            return None
        name, value = match.group("field_name", "field_value")
        found = (name, name.lower(), value)
        remember(_FIELDS, line, found, entries=MEMO_LINES, longest=MEMO_LINE_BYTES)
    return found


def _matched_lines(
    region: bytes, first_line: re.Pattern[bytes]
) -> tuple[Groups, list[Item]] | None:
    """A head's lines (`region`: the head without its closing blank line), each matched
    by h11's own grammar: `first_line` (its groups), then its header-field rule (the
    lines as h11's `Headers` keeps them: for a head without framing headers this is all
    h11's normalisation of a parsed head does, `normalize_and_validate` with `_parsed`
    checking and rewriting only Content-Length and Transfer-Encoding); None as soon as
    one line does not match (that head is h11's to read, and to refuse in its own words)."""
    lines = region.split(b"\r\n")
    first = _first_line(lines[0], first_line)
    if first is None:
        return None
    items = []
    for line in lines[1:]:
        item = _field(line)
        if item is None:
            return None
        items.append(item)
    return first, items


def _plain_head(head: bytes, first_line: re.Pattern[bytes]) -> tuple[Groups, list[Item]] | None:
    """A complete head's first line (its groups) and its headers as h11 keeps them
    (name, lower-case name, value), every line matched by h11's own grammar
    (`_matched_lines`), when the head has no framing header (Content-Length,
    Transfer-Encoding); None when any line does not match or framing is there: such a
    head goes to h11 whole, which says what is wrong or handles its framing."""
    if not head.endswith(b"\r\n\r\n"):
        return None
    matched = _matched_lines(head[:-4], first_line)
    if matched is None:
        return None
    for _, name, _ in matched[1]:
        if name in FRAMING:
            return None
    return matched


def plain_request(head: bytes) -> h11.Request | None:
    """The request of a complete head without framing headers (no body: RFC 9112 6.3),
    as h11 would make it; None for any other head (h11's to parse). A head made into
    a request is remembered by its bytes (`_REQUESTS`)."""
    found = _REQUESTS.get(head)
    if found is not None:
        return found
    plain = _plain_head(head, _H11_REQUEST_LINE)
    if plain is None:
        return None
    (method, target, version), items = plain
    try:
        found = h11.Request(
            method=method,
            target=target,
            http_version=version,
            headers=h11_headers.Headers(items),
            _parsed=True,
        )
    except h11.LocalProtocolError:
        return None  # h11 says so, in its words
    remember(_REQUESTS, head, found, entries=MEMO_HEADS, longest=MEMO_HEAD_BYTES)
    return found


def parse_reply(data: bytes) -> tuple[h11.Response, bytes] | None:
    """A reply head at the start of `data`, and the bytes after it, when all of it is
    there and every line matches h11's own grammar (its status line and header-field
    rules), made into h11's own Response the way h11's reader makes it (`_parsed`: the
    same Content-Length and Transfer-Encoding rules). None for anything else (a head
    not complete yet, an informational reply, bare LF line ends, obs-fold, a line
    the grammar refuses, framing h11 refuses): that reply is h11's to read, and to
    refuse in its own words."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    region = data[:end]
    response = _REPLIES.get(region)
    if response is None:
        matched = _matched_lines(region, _H11_STATUS_LINE)
        if matched is None:
            return None
        (version, status, reason), items = matched
        code = int(status)
        if code < 200:
            return None
        try:
            response = h11.Response(
                status_code=code,
                reason=reason or b"",
                http_version=version or b"1.1",
                headers=_normalised(items),
                _parsed=True,
            )
        except h11.LocalProtocolError:
            return None
        remember(_REPLIES, region, response, entries=MEMO_HEADS, longest=MEMO_HEAD_BYTES)
    return response, data[end + 4 :]


def _normalised(
    items: list[tuple[bytes, bytes, bytes]],
) -> h11_headers.Headers | list[tuple[bytes, bytes]]:
    """A reply's headers as h11 normalises a parsed head's. With no framing header,
    or a single Content-Length of plain digits (what h11 keeps as it is), that is the
    lines themselves, made into h11's `Headers` here; any other framing (a list of
    lengths, repeated lengths, Transfer-Encoding) is given to h11's own normalisation
    (its checks and refusals) as (name, value) pairs."""
    lengths = 0
    for _, name, value in items:
        if name == b"transfer-encoding":
            break
        if name == b"content-length":
            lengths += 1
            if not (value.isdigit() and value.isascii() and len(value) <= _MAX_LENGTH_DIGITS):
                break
    else:
        if lengths <= 1:
            return h11_headers.Headers(items)
    return [(raw, value) for raw, _, value in items]
