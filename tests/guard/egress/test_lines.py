"""`lines.head_facts`: a forwarded head's hash and its lines as the log shows them, the
same as made anew each time, with a credential's value masked; its memo bounded."""

from __future__ import annotations

import hashlib

from sandbox.guard.actionline import REDACTED
from sandbox.guard.egress import lines

HEAD = b"GET /x HTTP/1.1\r\nHost: a.test\r\nAuthorization: Bearer s3cret\r\nAccept: */*\r\n\r\n"


def test_a_heads_facts_are_its_hash_and_masked_lines_remembered_or_not() -> None:
    lines._HEADS.clear()
    want = (
        hashlib.sha256(HEAD).hexdigest(),
        ("GET /x HTTP/1.1", "Host: a.test", f"Authorization: {REDACTED}", "Accept: */*"),
    )
    assert lines.head_facts(HEAD) == want  # made
    assert lines.head_facts(HEAD) == want  # remembered
    assert HEAD in lines._HEADS
    assert (lines.sha(HEAD), tuple(lines.shown_head(HEAD))) == want


def test_the_head_memo_is_bounded_whatever_the_heads() -> None:
    lines._HEADS.clear()
    for n in range(3 * lines.MEMO_HEADS):
        head = b"GET /%d HTTP/1.1\r\nHost: a.test\r\n\r\n" % n
        assert lines.head_facts(head)[0] == hashlib.sha256(head).hexdigest()
        assert len(lines._HEADS) <= lines.MEMO_HEADS
    big = b"GET /" + b"x" * lines.MEMO_HEAD_BYTES + b" HTTP/1.1\r\nHost: a.test\r\n\r\n"
    assert lines.head_facts(big)[0] == hashlib.sha256(big).hexdigest()
    assert big not in lines._HEADS
