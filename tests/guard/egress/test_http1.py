"""The egress proxy's strict HTTP/1.1 checks (pure: bytes in, verdicts out)."""

from __future__ import annotations

import h11
import pytest

from sandbox.guard.egress import http1
from sandbox.guard.egress.http1 import Denied


def parse(head: bytes) -> h11.Request:
    end = http1.head_end(head)
    assert end == len(head)
    return http1.parse_request(head)[1]


def refused(head: bytes) -> Denied:
    with pytest.raises(Denied) as info:
        end = http1.head_end(head)
        assert end is not None, "incomplete"
        http1.parse_request(head[:end])
    return info.value


GOOD = b"GET http://a.test/x HTTP/1.1\r\nHost: a.test\r\nAccept: */*\r\n\r\n"


def test_a_plain_request_parses() -> None:
    request = parse(GOOD)
    assert (request.method, request.target) == (b"GET", b"http://a.test/x")


@pytest.mark.parametrize(
    ("head", "status", "words"),
    [
        (b"GET / HTTP/1.1\nHost: a\n\n", 400, "bare LF"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX: a\nY: b\r\n\r\n", 400, "bare LF"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX: a\rb\r\n\r\n", 400, "bare CR"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n", 400, "obs-fold"),
        (b"GET / HTTP/1.1\r\n Host: a\r\n\r\n", 400, "obs-fold"),
        (
            b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n",
            400,
            "more than one Content-Length",
        ),
        (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0, 0\r\n\r\n", 400, "plain decimal"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 007\r\n\r\n", 400, "plain decimal"),
        (
            b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
            "both",
        ),
        (
            b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
            "malformed",
        ),
        (b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 400, "malformed"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "malformed"),
        (b"GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400, "malformed"),
        (b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505, "HTTP/2.0"),
        (b"PRI * HTTP/2.0\r\n\r\n", 505, "HTTP/2.0"),
        (b"GET / HTTP/1.1\r\n\r\n", 400, "Host"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"a" * 70000 + b"\r\n\r\n", 431, "larger"),
        (b"GET / HTTP/1.1\r\nHost: a\r\n" + b"X: a\r\n" * 101 + b"\r\n", 431, "header lines"),
    ],
)
def test_ambiguous_heads_are_refused(head: bytes, status: int, words: str) -> None:
    refusal = refused(head)
    assert refusal.status == status and words in refusal.reason


def test_an_incomplete_head_waits_but_a_bare_lf_is_refused_at_once() -> None:
    assert http1.head_end(b"GET / HTTP/1.1\r\nHost: a\r") is None
    with pytest.raises(Denied):
        http1.head_end(b"GET / HTTP/1.1\nHost")  # no terminator yet: refused anyway
    with pytest.raises(Denied) as info:
        http1.head_end(b"G" * (http1.MAX_HEAD_BYTES + 1))
    assert info.value.status == 431
    with pytest.raises(Denied, match="bare CR"):
        http1.head_end(b"GET / HTTP/1.1\r\nHost: a\rb")  # a CR no LF can follow any more


def test_a_heads_line_ends_are_judged_up_to_its_end_and_not_past_it() -> None:
    head = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    # what follows is the next request's (or a body's), judged when its turn comes
    assert http1.head_end(head + b"GET /\nHost\r x") == len(head)
    assert http1.head_end(head + b"\r") == len(head)
    with pytest.raises(Denied, match="obs-fold"):
        http1.head_end(b"GET / HTTP/1.1\r\nHost: a\r\n\tb\r\n\r\n")


@pytest.mark.parametrize(
    ("target", "host", "port", "origin"),
    [
        (b"http://a.test/x?y=1", "a.test", 80, "/x?y=1"),
        (b"http://A.Test:8080", "a.test", 8080, "/"),
        (b"http://[fd00::1]:81/p", "fd00::1", 81, "/p"),
    ],
)
def test_absolute_targets(target: bytes, host: str, port: int, origin: str) -> None:
    assert http1.absolute_target(target) == http1.Target(host, port, origin)


@pytest.mark.parametrize(
    ("target", "words"),
    [
        (b"/x", "absolute"),
        (b"https://a.test/x", "absolute"),
        (b"http://user@a.test/x", "userinfo"),
        (b"http://a.test:80@b.test/x", "userinfo"),
        (b"http://a.test/x#frag", "absolute"),
        (b"http://a.test:99999/x", "out of range"),
        (b"http://a%2etest/x", "absolute"),
    ],
)
def test_bad_absolute_targets(target: bytes, words: str) -> None:
    with pytest.raises(Denied) as info:
        http1.absolute_target(target)
    assert words in info.value.reason


@pytest.mark.parametrize(
    ("target", "ok"),
    [
        (b"/x", True),
        (b"https://a.test/x", True),
        (b"https://a.test:443/x", True),
        (b"http://a.test/x", False),
        (b"https://b.test/x", False),
        (b"https://a.test:8443/x", False),
        (b"@b.test/x", False),
        (b"b.test/x", False),
        (b"*", False),
        (b"/x#y", False),
    ],
)
def test_targets_inside_a_tunnel_stay_on_its_host(target: bytes, ok: bool) -> None:
    if ok:
        assert http1.tunnel_target(target, "a.test", 443).host == "a.test"
    else:
        with pytest.raises(Denied):
            http1.tunnel_target(target, "a.test", 443)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (b"a.test", True),
        (b"A.TEST:80", True),
        (b"a.test.", True),
        (b"a.test:8080", False),
        (b"b.test", False),
        (b"a.test@b.test", False),
    ],
)
def test_the_host_header_must_name_the_target(value: bytes, ok: bool) -> None:
    request = parse(b"GET http://a.test/x HTTP/1.1\r\nHost: " + value + b"\r\n\r\n")
    if ok:
        http1.check_host(request, http1.fields(request), "a.test", 80, 80)
    else:
        with pytest.raises(Denied):
            http1.check_host(request, http1.fields(request), "a.test", 80, 80)


def test_forwarded_headers_drop_hop_by_hop_and_what_connection_names() -> None:
    request = parse(
        b"GET http://a.test/x HTTP/1.1\r\nHost: a.test\r\nConnection: keep-alive, X-Secret-Hop\r\n"
        b"X-Secret-Hop: 1\r\nProxy-Authorization: Basic eA==\r\nKeep-Alive: 5\r\nTE: trailers\r\n"
        b"Upgrade: h2c\r\nAccept: */*\r\nX-Mixed-Case: v\r\n\r\n"
    )
    assert http1.forward_headers(request) == [(b"Accept", b"*/*"), (b"X-Mixed-Case", b"v")]
    assert not http1.wants_keep_alive(
        parse(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    )
    assert not http1.wants_keep_alive(parse(b"GET / HTTP/1.0\r\n\r\n"))
    assert http1.wants_keep_alive(parse(GOOD))


def test_fields_index_each_header_by_lower_case_name_with_its_first_value() -> None:
    request = parse(
        b"GET http://a.test/x HTTP/1.1\r\nHost: a.test\r\nX-Twice: one\r\nACCEPT: */*\r\n"
        b"x-twice: two\r\nConnection: a\r\nConnection: B, c\r\n\r\n"
    )
    found = http1.fields(request)
    assert found == {
        b"host": b"a.test",
        b"x-twice": b"one",
        b"accept": b"*/*",
        b"connection": b"a",
    }
    # every Connection header's tokens, not only the first one's
    assert http1.connection_tokens(request) == {b"a", b"b", b"c"}
    assert http1.body_length(found) == 0


@pytest.mark.parametrize(
    ("method", "target", "headers"),
    [
        (b"GET", b"/x?q=1", [(b"Host", b"a.test"), (b"Accept", b"*/*")]),
        (b"HEAD", b"/", [(b"Host", b"a.test:8080")]),
        # Host not first in the list: h11 writes it first, and so must the proxy
        (b"GET", b"/p", [(b"X-A", b"1"), (b"Host", b"a.test"), (b"x-b", b"two words")]),
        (b"GET", b"/", [(b"Host", b"a.test"), (b"Connection", b"close")]),
    ],
)
def test_a_request_head_is_written_byte_for_byte_as_h11_writes_it(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    """The proxy writes a read's forwarded head itself (h11 only learns its framing);
    the bytes that leave are the ones h11 would have written."""
    conn = h11.Connection(h11.CLIENT)
    expected = conn.send(h11.Request(method=method, target=target, headers=headers))
    assert http1.request_head(method, target, headers) == expected


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET http://a.test/ HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET http://a.test/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET http://a.test/ HTTP/1.1\r\nBad Name: x\r\nHost: a\r\n\r\n", 400),
        (b"GET http://a.test/ HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n", 400),
        (b"GET http://a.test/ HTTP/2.0\r\nHost: a\r\n\r\n", 505),
        (b"GET  http://a.test/ HTTP/1.1\r\nHost: a\r\n\r\n", 400),
        (b"\r\nGET http://a.test/ HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ],
)
def test_a_head_the_grammar_refuses_is_refused_as_h11_refuses_it(head: bytes, status: int) -> None:
    with pytest.raises(Denied) as info:
        http1.parse_request(head)
    assert info.value.status == status


def test_a_head_with_framing_is_parsed_by_h11_and_keeps_its_connection() -> None:
    head = b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\n\r\n"
    conn, _ = http1.parse_request(head)
    assert conn is not None
    conn.receive_data(b"abc")
    assert isinstance(conn.next_event(), h11.Data)


@pytest.mark.parametrize(
    "headers",
    [
        [(b"Host", b"a.test"), (b"Content-Length", b"3")],
        [(b"Host", b"a.test"), (b"transfer-encoding", b"chunked")],
        [(b"X-A", b"1"), (b"CONTENT-LENGTH", b"0"), (b"Host", b"a.test")],
    ],
)
def test_a_head_that_frames_a_body_is_left_to_h11(headers: list[tuple[bytes, bytes]]) -> None:
    """The proxy writes only heads without a body; one that frames a body is h11's to
    write, so that h11 frames the body that follows it."""
    assert http1.request_head(b"POST", b"/", headers) is None


def test_a_remembered_target_or_host_is_judged_as_a_new_one_would_be() -> None:
    """A parse remembered is the parse again; a refusal is raised every time; a long
    target or Host value is never remembered; the memo stays bounded whatever the
    step names."""
    for _ in range(2):
        assert http1.absolute_target(b"http://A.test:81/x") == http1.Target("a.test", 81, "/x")
        with pytest.raises(Denied, match="out of range"):
            http1.absolute_target(b"http://a.test:99999/x")
    request = parse(b"GET http://a.test/x HTTP/1.1\r\nHost: a.test\r\n\r\n")
    found = http1.fields(request)
    http1.check_host(request, found, "a.test", 80, 80)
    # the same value against another judged host or port: refused, memo or not
    with pytest.raises(Denied):
        http1.check_host(request, found, "b.test", 80, 80)
    with pytest.raises(Denied):
        http1.check_host(request, found, "a.test", 8080, 80)
    http1.check_host(request, found, "a.test", 8080, 8080)  # no port: the default one
    long = b"http://a.test/" + b"x" * http1.MEMO_BYTES
    before = http1._remembered_target.cache_info().currsize
    assert http1.absolute_target(long).origin == "/" + "x" * http1.MEMO_BYTES
    assert http1._remembered_target.cache_info().currsize == before
    for n in range(http1.MEMO + 10):
        http1.absolute_target(b"http://a.test/%d" % n)
    assert http1._remembered_target.cache_info().currsize <= http1.MEMO


def test_connection_and_upgrade_tokens_come_from_every_such_header() -> None:
    request = parse(
        b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nConnection: Upgrade, X-A\r\n"
        b"Upgrade: WebSocket/13, , h2c\r\nconnection:  close \r\nUpgrade: foo\r\n\r\n"
    )
    assert http1.connection_tokens(request) == {b"upgrade", b"x-a", b"close"}
    assert http1.upgrade_tokens(request) == [b"websocket", b"h2c", b"foo"]
    assert http1.connection_tokens(parse(GOOD)) == set()
    assert http1.upgrade_tokens(parse(GOOD)) == []


def _judged_by_the_pattern(buffer: bytes) -> int | str | None:
    """What `head_end` says, as the pattern alone says it (its search at every byte)."""
    end = buffer.find(b"\r\n\r\n")
    stop = end + 4 if end >= 0 else len(buffer)
    found = http1._AMBIGUOUS.search(buffer, 0, stop)
    if found is not None and not (end < 0 and found.group() == b"\r" and found.end() == stop):
        return found.group().decode()[:2]
    return end + 4 if end >= 0 else None


def test_a_heads_line_ends_counted_say_what_the_pattern_says() -> None:
    """`head_end` counts CR, LF and CRLF before it searches: over every short run of
    line-end bytes, whitespace and text, it passes, waits for and refuses exactly the
    heads the pattern's search does, for the same reason."""
    import itertools

    reasons = {"\n": "bare LF", "\r": "bare CR", "\r\n": "obs-fold"}
    alphabet = [b"a", b"\r", b"\n", b" ", b"\t"]
    for size in range(1, 7):
        for parts in itertools.product(alphabet, repeat=size):
            buffer = b"GET / HTTP/1.1" + b"".join(parts) + b"\r\n\r\n"[: size % 5]
            expected = _judged_by_the_pattern(buffer)
            if isinstance(expected, str):
                with pytest.raises(Denied, match=reasons[expected]):
                    http1.head_end(buffer)
            else:
                assert http1.head_end(buffer) == expected, buffer
