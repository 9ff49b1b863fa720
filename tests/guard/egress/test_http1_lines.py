"""The two paths for one head: `http1_lines` (h11's line patterns, no connection) and
an h11 connection. The same valid and hostile heads go through both: whatever the
line path takes is exactly the event h11 makes of it; whatever h11 refuses or cannot
finish, the line path leaves to h11."""

from __future__ import annotations

import h11
import pytest

from sandbox.guard.egress import http1, http1_lines

GOOD = b"GET http://a.test/x HTTP/1.1\r\nHost: a.test\r\nAccept: */*\r\n\r\n"

# (kind, bytes, whether the line path takes it)
CASES = [
    # request heads without framing: the line path's
    ("request", GOOD, True),
    ("request", b"HEAD http://a.test:8080/p?q=1&r=%20 HTTP/1.1\r\nHost: a.test:8080\r\n\r\n", True),
    ("request", b"GET http://a.test/ HTTP/1.0\r\n\r\n", True),
    (
        "request",
        b"GET http://a.test/ HTTP/1.1\r\nhost:a.test\r\nX-Empty:\r\nX-Pad: \t v a l \t\r\n\r\n",
        True,
    ),
    (
        "request",
        b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nConnection: keep-alive, x-a\r\n\r\n",
        True,
    ),
    ("request", b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n", True),
    # an h2c upgrade is an HTTP/1.1 head (the proxy refuses it after the parse)
    (
        "request",
        b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
        True,
    ),
    # a version h11's grammar takes and `check_request` refuses afterwards (505)
    ("request", b"GET http://a.test/ HTTP/2.0\r\nHost: a\r\n\r\n", True),
    # hostile request heads: h11 refuses them, the line path leaves them to h11
    ("request", b"GET http://a.test/ HTTP/1.1\r\n\r\n", False),  # no Host
    ("request", b"GET http://a.test/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", False),
    ("request", b"GET http://a.test/ HTTP/1.1\r\nBad Name: x\r\nHost: a\r\n\r\n", False),
    ("request", b"GET http://a.test/ HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n", False),
    ("request", b"GET  http://a.test/ HTTP/1.1\r\nHost: a\r\n\r\n", False),
    ("request", b"\r\nGET http://a.test/ HTTP/1.1\r\nHost: a\r\n\r\n", False),
    ("request", b"GET http://a.test/ HTTP/1.1\nHost: a\n\n", False),  # bare LF
    ("request", b"GET http://a.test/ HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n", False),
    ("request", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", False),  # h2 preface: h11's to refuse
    # framing headers: always h11's (it frames the body)
    ("request", b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\n\r\n", False),
    (
        "request",
        b"POST http://a.test/ HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n",
        False,
    ),
    # reply heads that arrived whole
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", True),
    ("reply", b"HTTP/1.0 404 Not Found\r\nServer: x\r\nContent-Type: text/plain\r\n\r\n", True),
    ("reply", b"HTTP/1.1 204 \r\nX-Pad:  a b \t\r\n\r\n", True),
    ("reply", b"HTTP/1.1 200\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nok", True),
    ("reply", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", True),
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n", True),  # body on its way
    # lengths h11 keeps as they are (made into h11's Headers by the line path) and
    # those it rewrites (a list of one length; the same length twice: h11 keeps one)
    ("reply", b"HTTP/1.1 200 OK\r\ncontent-length:  007 \r\nX: y\r\n\r\n", True),
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: 1, 1\r\n\r\nx", True),
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nX: y\r\nContent-Length: 1\r\n\r\nx", True),
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 20 + b"\r\n\r\n", True),
    # replies the line path leaves to h11
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n", False),  # not complete yet
    ("reply", b"HTTP/1.1 200 OK\nContent-Length: 5\n\nhello", False),  # bare LF
    ("reply", b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\n\r\n", False),  # obs-fold
    ("reply", b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", False),
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", False),
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", False),
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 21 + b"\r\n\r\n", False),
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: \xd9\xa1\r\n\r\nx", False),  # not ASCII
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\nx", False),
    ("reply", b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: gzip\r\n\r\n", False),
    ("reply", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", False),
    ("reply", b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n", False),
    ("reply", b"HTTP/1.1 2000 OK\r\n\r\n", False),
    ("reply", b"SPDY/3 200 OK\r\n\r\n", False),
    ("reply", b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n", False),
]


def _by_h11(
    kind: str, data: bytes
) -> h11.Request | h11.Response | h11.InformationalResponse | None:
    """What an h11 connection makes of `data`: its first event, or None when it refuses
    the bytes or needs more."""
    if kind == "request":
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=http1.MAX_HEAD_BYTES)
    else:
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method=b"GET", target=b"/", headers=[(b"Host", b"a")]))
        conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return None
    if isinstance(event, h11.Request | h11.Response | h11.InformationalResponse):
        return event
    return None  # NEED_DATA


@pytest.mark.parametrize(("kind", "data", "taken"), CASES)
def test_both_paths_read_a_head_alike(kind: str, data: bytes, taken: bool) -> None:
    expected = _by_h11(kind, data)
    if kind == "request":
        fast: h11.Request | h11.Response | None = http1_lines.plain_request(data)
        rest = b""
    else:
        parsed = http1_lines.parse_reply(data)
        fast, rest = parsed if parsed is not None else (None, b"")
    assert (fast is not None) == taken
    if expected is None:  # h11 refuses it or needs more: the line path must not take it
        assert fast is None
        return
    if fast is None:
        return  # left to h11, which reads it
    assert type(fast) is type(expected)
    assert list(fast.headers.raw_items()) == list(expected.headers.raw_items())
    assert list(fast.headers) == list(expected.headers)
    if isinstance(fast, h11.Request):
        assert isinstance(expected, h11.Request)
        assert (fast.method, fast.target, fast.http_version) == (
            expected.method,
            expected.target,
            expected.http_version,
        )
        if fast.http_version in http1.VERSIONS:  # the proxy's parse takes the same path
            assert http1.parse_request(data)[0] is None
    else:
        assert isinstance(expected, h11.Response)
        assert (fast.status_code, fast.reason, fast.http_version) == (
            expected.status_code,
            expected.reason,
            expected.http_version,
        )
        assert rest == data[data.index(b"\r\n\r\n") + 4 :]


def test_remembered_lines_read_as_h11_reads_them_every_time() -> None:
    """With every case's lines and heads remembered (each head read twice, some lines
    shared between heads), every head still reads as h11 reads it: taken alike,
    refused alike."""
    for _ in range(2):
        for kind, data, taken in CASES:
            test_both_paths_read_a_head_alike(kind, data, taken)


def test_the_line_memo_is_bounded_whatever_the_heads() -> None:
    """Distinct lines past the memo's size empty it (it never holds more than
    MEMO_LINES); a long line is matched, not remembered; each head reads right."""
    http1_lines._FIELDS.clear()
    for n in range(3 * http1_lines.MEMO_LINES):
        head = b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nX-N: %d\r\n\r\n" % n
        request = http1_lines.plain_request(head)
        assert request is not None
        assert request.headers.raw_items()[-1] == (b"X-N", b"%d" % n)
        assert len(http1_lines._FIELDS) <= http1_lines.MEMO_LINES
    long_value = b"v" * http1_lines.MEMO_LINE_BYTES
    head = b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nX-Long: " + long_value + b"\r\n\r\n"
    request = http1_lines.plain_request(head)
    assert request is not None and request.headers.raw_items()[-1] == (b"X-Long", long_value)
    assert b"X-Long: " + long_value not in http1_lines._FIELDS


def test_the_head_memo_is_bounded_and_keeps_no_refused_head() -> None:
    """A head made into its event is remembered by its bytes (the same event again),
    at most MEMO_HEADS per direction whatever the heads; a head too long to keep, or
    one the line path refuses, is read again each time."""
    http1_lines._REQUESTS.clear()
    http1_lines._REPLIES.clear()
    assert http1_lines.plain_request(GOOD) is http1_lines.plain_request(GOOD)
    for n in range(3 * http1_lines.MEMO_HEADS):
        head = b"GET http://a.test/%d HTTP/1.1\r\nHost: a.test\r\n\r\n" % n
        request = http1_lines.plain_request(head)
        assert request is not None and request.target == b"http://a.test/%d" % n
        assert len(http1_lines._REQUESTS) <= http1_lines.MEMO_HEADS
        reply = b"HTTP/1.1 200 OK\r\nX-N: %d\r\n\r\nbody" % n
        parsed = http1_lines.parse_reply(reply)
        assert parsed is not None and parsed[0].headers.raw_items() == [(b"X-N", b"%d" % n)]
        assert parsed[1] == b"body"
        assert len(http1_lines._REPLIES) <= http1_lines.MEMO_HEADS
    long_head = b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nX: "
    long_head += b"v" * http1_lines.MEMO_HEAD_BYTES + b"\r\n\r\n"
    assert http1_lines.plain_request(long_head) is not None
    assert long_head not in http1_lines._REQUESTS
    framed = b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nContent-Length: 0\r\n\r\n"
    bad = b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nBad Name: x\r\n\r\n"
    informational = b"HTTP/1.1 100 Continue\r\n\r\n"
    for _ in range(2):
        assert http1_lines.plain_request(framed) is None
        assert http1_lines.plain_request(bad) is None
        assert http1_lines.parse_reply(informational) is None
    assert framed not in http1_lines._REQUESTS and bad not in http1_lines._REQUESTS
    assert informational[:-4] not in http1_lines._REPLIES
