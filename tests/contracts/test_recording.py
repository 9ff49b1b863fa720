"""The recording's key and index line written without the general encoder or a model:
the same bytes as `key_of` and as the model's own JSON (a recording made by one
guard matches in the next only while the key's bytes stay the same)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sandbox.contracts.recording import (
    EMPTY_SHA256,
    IndexLine,
    egress_key,
    index_line_json,
    key_of,
)
from sandbox.contracts.wire import json_of

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


GOOD = [
    {"key": DIGEST, "kind": "egress", "what": "GET http://a.test/", "kept": True, "size": 3},
    {
        "key": DIGEST,
        "kind": "mcp",
        "what": 'srv/tool "é" \\ \x01 ☃',
        "kept": False,
        "size": 0,
        "sha256": EMPTY_SHA256,
        "why_not": "over the per-answer cap of 16 bytes",
        "replay": "live",
    },
    {"key": DIGEST, "kind": "bridge", "what": "x" * 600, "kept": True, "size": 2**40},
]


@pytest.mark.parametrize("fields", GOOD)
def test_an_index_line_is_the_models_own_json(fields: dict[str, object]) -> None:
    model = IndexLine(**{("bytes" if k == "size" else k): v for k, v in fields.items()})  # type: ignore[arg-type]
    assert index_line_json(**fields) == json_of(model)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"key": "AB" * 32},
        {"key": DIGEST + "\n"},
        {"sha256": "ab" * 31},
        {"kind": "other"},
        {"what": "x" * 601},
        {"size": -1},
        {"replay": "maybe"},
    ],
)
def test_an_index_line_the_model_refuses_is_refused(change: dict[str, object]) -> None:
    fields = {**GOOD[0], **change}
    with pytest.raises(ValidationError):
        index_line_json(**fields)  # type: ignore[arg-type]
