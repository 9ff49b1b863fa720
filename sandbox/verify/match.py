"""Matchers applied to JSON values: pure functions, no I/O.

JSON semantics, not Python's: `true` is not `1`, `1` equals `1.0`. A path that
leads nowhere is a mismatch (or what `exists = false` asks for), never an error.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sandbox.verify.expect import Match, parse_json_path


class _Missing:
    def __repr__(self) -> str:
        return "(absent)"


MISSING: Any = _Missing()


def select(value: Any, path: str | None) -> Any:
    """The part of `value` at the JSON path, or MISSING."""
    if path is None:
        return value
    for part in parse_json_path(path):
        in_list = isinstance(part, int) and isinstance(value, list) and 0 <= part < len(value)
        if in_list or (isinstance(part, str) and isinstance(value, dict) and part in value):
            value = value[part]
        elif isinstance(part, int) and isinstance(value, dict) and str(part) in value:
            value = value[str(part)]
        else:
            return MISSING
    return value


def json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


def json_subset(expected: Any, actual: Any) -> bool:
    """`actual` holds `expected`: objects by key (recursively), everything else equal."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            k in actual and json_subset(v, actual[k]) for k, v in expected.items()
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(expected)
            and all(json_subset(e, a) for e, a in zip(expected, actual, strict=True))
        )
    return json_equal(expected, actual)


def show(value: Any, limit: int = 120) -> str:
    """A short JSON rendering of a value for a verdict line."""
    if value is MISSING:
        return "(absent)"
    text = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def matches(m: Match, value: Any) -> bool:
    part = select(value, m.path)
    if m.exists is not None:
        return (part is not MISSING) == m.exists
    if part is MISSING:
        return False
    if "equals" in m.model_fields_set:
        return json_equal(m.equals, part)
    if m.subset is not None:
        return json_subset(m.subset, part)
    if m.regex is not None:
        return isinstance(part, str) and re.search(m.regex, part) is not None
    if m.contains is not None:
        return isinstance(part, str) and m.contains in part
    return False


def first_mismatch(ms: list[Match], value: Any) -> tuple[Match, Any] | None:
    """The first matcher `value` fails, with what stood at its path."""
    for m in ms:
        if not matches(m, value):
            return m, select(value, m.path)
    return None
