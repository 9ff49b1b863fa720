"""One list of credential words for the whole action log: an argument's key and a
forwarded header's name are redacted by the same words."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from sandbox.guard.actionline import (
    _PLAIN_KEYS,
    MAX_DEPTH,
    MAX_ITEMS,
    MEMO_KEYS,
    REDACTED,
    redact,
)
from sandbox.guard.egress.lines import shown_head
from tests.guard.actionlogparts import full_walk

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


# -- the walk's fast paths against the full walk ---------------------------------------


class _Text(str):
    """A str subclass: walked as a string, never taken for one by its type alone."""


def _hostile(rng: random.Random, depth: int = 0) -> Any:
    """A nested value of short texts over a small alphabet (so the secrets below occur
    inside values, across values and in keys), of every kind the walk tells apart."""

    def text() -> str:
        return "".join(rng.choice("abt") for _ in range(rng.choice([0, 1, 2, 3, 5, 8, 40])))

    kind = rng.randrange(10 if depth < 8 else 5)
    if kind == 0:
        return text()
    if kind == 1:
        return _Text(text())
    if kind == 2:
        return text().encode()  # bytes: written as their str(), searched as that
    if kind == 3:
        return rng.choice([None, True, False, 0, 7, -1.5, float("nan")])
    if kind == 4:
        return text() * rng.choice([1, 60])  # past MAX_VALUE_CHARS: cut and hashed
    if kind in (5, 6):
        keys = [text(), "token" + text(), rng.randrange(3), "t" * rng.choice([2, 70])]
        return {rng.choice(keys): _hostile(rng, depth + 1) for _ in range(rng.randrange(6))}
    items = [_hostile(rng, depth + 1) for _ in range(rng.randrange(6))]
    return tuple(items) if kind == 7 else items


def _nested(wrap: Callable[[Any], Any]) -> Any:
    """ "ab" wrapped past MAX_DEPTH levels."""
    value: Any = "ab"
    for _ in range(MAX_DEPTH + 3):
        value = wrap(value)
    return value


HOSTILE_SECRETS = [(), ("",), ("ab",), ("ba", "aab"), ("a",), ("", "tat", "ab" * 30), ("b" * 3,)]


@pytest.mark.parametrize("secrets", HOSTILE_SECRETS)
def test_the_walk_writes_what_the_full_walk_writes(secrets: tuple[str, ...]) -> None:
    """Strings too short for any secret kept without the search, dicts tested first,
    a plain key's answer remembered: the same JSON as the full walk, byte for byte,
    for secrets inside, across and beside values, in keys, in bytes, nested past
    MAX_DEPTH, in containers past MAX_ITEMS (each value walked twice: remembered keys)."""
    rng = random.Random(33)
    edge: list[Any] = [
        {"a": "a", "b": "b", "ab": ["a", "b"], "x": ("ab", b"ab", _Text("ab"))},
        {"method": "GET", "url": "http://a.test/ab", "forwarded_head": ("GET / HTTP/1.1",)},
        {1: "ab", "1": "ba", "[cut]": "x", **{f"k{i}": "ab" for i in range(MAX_ITEMS + 3)}},
        ["aab"] * (MAX_ITEMS + 2),
        _nested(lambda inner: [inner, "ab"]),
        _nested(lambda inner: {"k": inner}),
        "ab" * 1500,
        "a" * 1999 + "b",
        "a" * 2001,
        "tat",
    ]
    for value in edge + [_hostile(rng) for _ in range(400)]:
        expected = json.dumps(full_walk(value, secrets))
        for _ in range(2):
            assert json.dumps(redact(value, secrets)) == expected, value


def test_the_plain_keys_remembered_are_bounded() -> None:
    for i in range(3 * MEMO_KEYS):
        assert redact({f"key{i}": 1}) == {f"key{i}": 1}
        assert len(_PLAIN_KEYS) <= MEMO_KEYS
    assert redact({"y" * 65: 1}) == {"y" * 65: 1}
    assert "y" * 65 not in _PLAIN_KEYS  # a long key is searched each time
    assert redact({"session_token": 1}) == {"session_token": REDACTED}
    assert "session_token" not in _PLAIN_KEYS
