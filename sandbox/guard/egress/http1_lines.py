"""A request or reply head matched line by line with h11's own grammar, made into
h11's own event without an h11 connection (`http1`'s second path for the same heads).

A read's request head and a small reply head that arrived whole are the proxy's
every request; an h11 connection and its state machine cost more per request than
the rest of the parse, so these heads are matched here with the patterns h11's
readers use and made into events the way h11's reader makes them (`_parsed`). Any
head this module does not take (a line the grammar refuses, framing headers, an
informational reply) returns None and goes to h11 whole, which refuses it in its
own words. tests/guard/egress/test_http1_lines.py runs the same valid and hostile
heads through both paths.
"""

from __future__ import annotations

import re

import h11
from h11 import _headers as h11_headers
from h11 import _readers as h11_readers

# h11's own grammar for a request line, a status line and a header field (the
# patterns its readers match each line with), so that a head parsed here is accepted
# exactly when h11 would accept it.
_H11_REQUEST_LINE: re.Pattern[bytes] = h11_readers.request_line_re
_H11_STATUS_LINE: re.Pattern[bytes] = h11_readers.status_line_re
_H11_FIELD: re.Pattern[bytes] = h11_readers.header_field_re
# The headers that frame a body: a head with one goes to h11 whole (`http1` asks too).
FRAMING = frozenset({b"content-length", b"transfer-encoding"})
_MAX_LENGTH_DIGITS = h11_headers.CONTENT_LENGTH_MAX_DIGITS


def _matched_lines(region: bytes, first_line: re.Pattern[bytes]) -> list[re.Match[bytes]] | None:
    """A head's lines (`region`: the head without its closing blank line), each matched
    by h11's own grammar: `first_line`, then its header-field rule; None as soon as one
    line does not match (that head is h11's to read, and to refuse in its own words)."""
    lines = region.split(b"\r\n")
    first = first_line.fullmatch(lines[0])
    if first is None:
        return None
    matches = [first]
    for line in lines[1:]:
        match = _H11_FIELD.fullmatch(line)
        if match is None:
            return None
        matches.append(match)
    return matches


def _plain_head(
    head: bytes, first_line: re.Pattern[bytes]
) -> tuple[re.Match[bytes], list[tuple[bytes, bytes, bytes]]] | None:
    """A complete head's first line and its headers as h11 keeps them (name, lower-case
    name, value), every line matched by h11's own grammar (`_matched_lines`), when the
    head has no framing header (Content-Length, Transfer-Encoding); None when any line
    does not match or framing is there: such a head goes to h11 whole, which says what
    is wrong or handles its framing."""
    if not head.endswith(b"\r\n\r\n"):
        return None
    matches = _matched_lines(head[:-4], first_line)
    if matches is None:
        return None
    items = _items_of(matches)
    for _, name, _ in items:
        if name in FRAMING:
            return None
    return matches[0], items


def _items_of(matches: list[re.Match[bytes]]) -> list[tuple[bytes, bytes, bytes]]:
    """The header lines as h11's `Headers` keeps them: (name, lower-case name, value).
    For a head without framing headers this is all h11's normalisation of a parsed
    head does (`normalize_and_validate` with `_parsed`: it checks and rewrites only
    Content-Length and Transfer-Encoding), so h11's `Headers` is made from it directly."""
    items = []
    for match in matches[1:]:
        name, value = match.group("field_name", "field_value")
        items.append((name, name.lower(), value))
    return items


def plain_request(head: bytes) -> h11.Request | None:
    """The request of a complete head without framing headers (no body: RFC 9112 6.3),
    as h11 would make it; None for any other head (h11's to parse)."""
    plain = _plain_head(head, _H11_REQUEST_LINE)
    if plain is None:
        return None
    line, items = plain
    try:
        return h11.Request(
            method=line.group("method"),
            target=line.group("target"),
            http_version=line.group("http_version"),
            headers=h11_headers.Headers(items),
            _parsed=True,
        )
    except h11.LocalProtocolError:
        return None  # h11 says so, in its words


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
    matches = _matched_lines(data[:end], _H11_STATUS_LINE)
    if matches is None:
        return None
    status = matches[0]
    code = int(status.group("status_code"))
    if code < 200:
        return None
    items = _items_of(matches)
    try:
        response = h11.Response(
            status_code=code,
            reason=status.group("reason") or b"",
            http_version=status.group("http_version") or b"1.1",
            headers=_normalised(items),
            _parsed=True,
        )
    except h11.LocalProtocolError:
        return None
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
