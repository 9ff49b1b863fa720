"""One list of credential words for the whole action log: an argument's key and a
forwarded header's name are redacted by the same words."""

from __future__ import annotations

import pytest

from sandbox.guard.actionline import REDACTED, redact
from sandbox.guard.egress.lines import shown_head

WORDS = ["password", "X-Api-Key", "Authorization", "session_token", "private_key", "Signature"]


@pytest.mark.parametrize("word", WORDS)
def test_a_credential_word_is_redacted_in_arguments_and_in_forwarded_headers(word: str) -> None:
    assert redact({word: "s3cr3t"}) == {word: REDACTED}
    head = f"GET / HTTP/1.1\r\nHost: a.test\r\n{word}: s3cr3t\r\n\r\n".encode()
    shown = "\n".join(shown_head(head))
    assert "s3cr3t" not in shown and REDACTED in shown


def test_other_words_are_kept() -> None:
    assert redact({"job_id": 42}) == {"job_id": 42}
    assert "a.test" in "\n".join(shown_head(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n"))


def test_a_credential_header_is_redacted_every_time_whatever_its_names_length() -> None:
    """A header name's answer is remembered only for short names; a long one is
    searched each time, and both are redacted every time they come."""
    for name in ("Authorization", "X-" + "a" * 80 + "-Token", "X-" + "b" * 80):
        for _ in range(2):
            head = f"GET / HTTP/1.1\r\nHost: a.test\r\n{name}: s3cr3t\r\n\r\n".encode()
            shown = "\n".join(shown_head(head))
            assert ("s3cr3t" in shown) is name.startswith("X-b")


def test_a_credential_key_is_redacted_whatever_its_length() -> None:
    long_secret, long_plain = "x" * 70 + "_token", "y" * 70
    for _ in range(2):
        assert redact({"api_key": "s", long_secret: "s", long_plain: "p"}) == {
            "api_key": REDACTED,
            long_secret: REDACTED,
            long_plain: "p",
        }
