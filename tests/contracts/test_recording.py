"""The recording's match key and index line: a replay finds what an earlier run kept
only while the same read makes the same key, so the key is pinned to its canonical
JSON, and the key and the index line written without the general encoder or a model
are the same bytes as `key_of` and as the model's own JSON."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from pydantic import ValidationError

from sandbox.contracts.recording import (
    EMPTY_SHA256,
    KEY_VERSION,
    IndexLine,
    bridge_key_of,
    egress_key,
    index_line_json,
    key_of,
)

DIGEST = "ab" * 32


@pytest.mark.parametrize(
    ("method", "url", "body"),
    [
        ("GET", "http://a.test/x?y=1", EMPTY_SHA256),
        ("POST", 'https://a.test/"quoted"\\back', DIGEST),
        ("GET", "http://a.test/é/☃/\U0001f600", EMPTY_SHA256),
        ("GET", "http://a.test/\x00\x1f\x7f\t\n/", EMPTY_SHA256),
        ("", "", ""),
    ],
)
def test_an_egress_key_is_key_of_its_parts(method: str, url: str, body: str) -> None:
    expected = key_of("egress", method=method, url=url, body_sha256=body)
    assert egress_key(method, url, body) == expected


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        ("generate_text_llm", {"prompt": "bench"}),
        ("t", {}),
        ('q"uo\\te\n', {"z": 1, "a": [1, 2.5, None, True], "m": {"y": "é☃\U0001f600", "b": {}}}),
        ("t", {"nan": float("nan"), "inf": float("-inf"), "big": 2**80, "neg": -0.0}),
        ("t", {"\x00\x1f": "\x7f\t", "v": 1, "kind": "egress", "arguments": []}),
    ],
)
def test_a_bridge_key_is_key_of_its_parts(tool: str, arguments: dict[str, Any]) -> None:
    assert bridge_key_of(tool, arguments) == key_of("bridge", tool=tool, arguments=arguments)


_INDEX_LINES = [
    {
        "key": DIGEST,
        "kind": "bridge",
        "what": "bridge generate_text_llm",
        "kept": True,
        "bytes": 354,
        "sha256": DIGEST,
    },
    {
        "key": DIGEST,
        "kind": "egress",
        "what": 'GET https://h/p?q="x"\\\n',
        "kept": False,
        "bytes": 0,
        "why_not": "over the body cap",
        "replay": "miss",
    },
    {
        "key": DIGEST,
        "kind": "mcp",
        "what": "mcp srv/t\u00e9l\u00e9",
        "kept": False,
        "bytes": 2**70,
        "why_not": "cut short \u2014 late",
        "replay": "live",
    },
    {
        "key": DIGEST,
        "kind": "mcp",
        "what": "w" * 600,
        "kept": True,
        "bytes": 0,
        "sha256": DIGEST,
        "replay": "hit",
    },
]


@pytest.mark.parametrize("fields", _INDEX_LINES)
def test_an_index_line_is_the_model_s_json_byte_for_byte(fields: dict[str, object]) -> None:
    """Every recorded answer's line is encoded without a model: the same bytes."""
    given = dict(fields)
    size = given.pop("bytes")
    expected = IndexLine.model_validate(fields).model_dump_json().encode()
    assert index_line_json(**given, size=size) == expected  # type: ignore[arg-type]


_BAD_INDEX_LINES = [
    {"key": DIGEST + "\n"},
    {"key": DIGEST.upper()},
    {"sha256": "0" * 63},
    {"kind": "file"},
    {"what": "w" * 601},
    {"what": "\u00e9" * 601},
    {"size": -1},
    {"replay": "later"},
    {"kept": "maybe"},
]


@pytest.mark.parametrize("change", _BAD_INDEX_LINES)
def test_an_index_line_the_model_refuses_is_refused_as_the_model_refuses_it(
    change: dict[str, object],
) -> None:
    fields: dict[str, object] = {"key": DIGEST, "kind": "bridge", "what": "w", "kept": True}
    fields["size"] = 1
    fields |= change
    model_fields = {("bytes" if k == "size" else k): v for k, v in fields.items()}
    with pytest.raises(ValidationError) as want:
        IndexLine.model_validate(model_fields)
    with pytest.raises(ValidationError) as got:
        index_line_json(**fields)  # type: ignore[arg-type]
    assert got.value.errors() == want.value.errors()


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
    if kind == "bridge":
        assert bridge_key_of(**parts) == key
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
