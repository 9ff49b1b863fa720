"""The recording's match key: a replay finds what an earlier run kept only while the
same read makes the same key, so the key is pinned to its canonical JSON."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from sandbox.contracts.recording import KEY_VERSION, key_of

ARGUMENTS = {"prompt": "bench", "z": [1.5, 1e16, None, True], "é": {"b": 2, "a": '\u2028"'}}


@pytest.mark.parametrize(
    ("kind", "parts", "key"),
    [
        (
            "bridge",
            {"tool": "generate_text_llm", "arguments": ARGUMENTS},
            "b702cda59e8f295ed299d7f59e0fbbc686286555e854f32ac078043dc8268760",
        ),
        (
            "egress",
            {"method": "GET", "url": "https://h/p", "body_sha256": ""},
            "abf2138538b4da38e622093cf283f2f262471dbed25756d6e8ca8b6b0d12d9a0",
        ),
    ],
)
def test_a_read_s_key_is_the_same_as_every_earlier_run_s(
    kind: Any, parts: dict[str, Any], key: str
) -> None:
    assert key_of(kind, **parts) == key
    canonical = json.dumps(
        {"v": KEY_VERSION, "kind": kind, **parts},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert hashlib.sha256(canonical.encode()).hexdigest() == key


def test_a_key_does_not_depend_on_the_arguments_order() -> None:
    reordered = dict(reversed(list(ARGUMENTS.items())))
    assert key_of("bridge", tool="t", arguments=reordered) == key_of(
        "bridge", tool="t", arguments=ARGUMENTS
    )
