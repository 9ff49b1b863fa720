"""An action line is the line the record model writes from the fully redacted fields.

`action_line` builds, redacts and encodes a line with fast paths (an empty argument
dict not walked, a short reason not searched, the secrets' floor remembered by the
tuple's identity, the model's checks by hand); here it is compared byte for byte with
the line made without any of them: the full walk (every string searched, every key's
words searched), the reason searched, the model's own serializer, for many shapes of
fields and secrets tuples, alternating."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sandbox.contracts.wire import ActionLine
from sandbox.guard.actionline import (
    MAX_LINE_BYTES,
    MAX_VALUE_CHARS,
    _model_line,
    _summarized,
    action_line,
    redact_text,
)
from tests.guard.actionlogparts import full_walk

# Secrets over the texts' own small alphabet, so they occur inside, across and beside
# values, in keys and in the reason; "" and one-letter secrets too.
SECRETS = st.tuples() | st.lists(
    st.text("abt", min_size=0, max_size=4) | st.just("ab" * 30), min_size=1, max_size=3
).map(tuple)
TEXT = st.text("abt", max_size=8) | st.text('abt\u00e9\u2028"\\\n', max_size=5)
LONG = st.builds(lambda t, n: (t or "a") * n, TEXT, st.sampled_from([300, 2100]))
KEYS = TEXT | st.builds(lambda t: "token" + t, TEXT) | st.integers(0, 3) | st.just("t" * 70)
SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT | LONG
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(KEYS, inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = st.fixed_dictionaries(
    {
        "session": st.sampled_from(["root", "egress", "s-0123456789ab"]),
        "tool": TEXT | st.just("t" * 300),
        "decision": st.sampled_from(["allow", "stub", "redirect", "refuse"]),
        "reason": TEXT | LONG | st.integers(0, 9) | st.just(""),
        "category": TEXT,
        "arguments": st.dictionaries(KEYS, VALUES, max_size=5)
        | st.just({})
        | st.builds(lambda v: {f"k{n}": v for n in range(40)}, LONG),  # past MAX_LINE_BYTES
        "duration_ms": st.none() | st.floats(0, 1e6) | st.just(math.inf),
        "detail": st.none() | st.dictionaries(KEYS, VALUES, max_size=4),
        "kind": st.sampled_from(
            [
                ("call", None, None),
                ("start", "c1", None),
                ("outcome", "c7", "ok"),
                ("outcome", "c" * 40, "error"),
            ]
        ),
    }
)


def _reference(step: str, secrets: tuple[str, ...], f: dict[str, Any], line: bytes) -> bytes:
    """The line as made without a fast path, at the fast line's own time."""
    event, call_id, outcome = f["kind"]
    prepared = {k: v for k, v in f.items() if k != "kind"}
    prepared.update(event=event, call_id=call_id, outcome=outcome)
    prepared["arguments"] = full_walk(f["arguments"], secrets)
    prepared["detail"] = full_walk(f["detail"] or {}, secrets)
    prepared["tool"] = str(f["tool"])[:200]
    prepared["reason"] = redact_text(str(f["reason"]), secrets)
    if prepared["duration_ms"] is not None:
        prepared["duration_ms"] = round(prepared["duration_ms"], 3)
    now = ActionLine.model_validate_json(line).time
    model = _model_line(now, step, prepared)
    if len(model) > MAX_LINE_BYTES:
        prepared["arguments"] = _summarized(prepared["arguments"])
        prepared["detail"] = _summarized(prepared["detail"])
        model = _model_line(now, step, prepared)
    return model


def _fast(step: str, secrets: tuple[str, ...], f: dict[str, Any]) -> bytes:
    event, call_id, outcome = f["kind"]
    return action_line(
        step, secrets, event, call_id, outcome, f["session"], f["tool"], f["decision"],
        f["reason"], f["category"], f["arguments"], f["duration_ms"], f["detail"],
    )  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(SECRETS, FIELDS), min_size=1, max_size=3))
def test_a_line_is_the_model_s_line_of_the_fully_redacted_fields(
    lines: list[tuple[tuple[str, ...], dict[str, Any]]],
) -> None:
    """Several lines in a row with different secrets tuples (the floor remembered for
    the last tuple must never serve another), each twice (remembered plain keys)."""
    for secrets, fields in lines:
        for _ in range(2):
            line = _fast("s", secrets, fields)
            assert line == _reference("s", secrets, fields, line)


def test_a_reason_a_secret_long_or_longer_is_searched_and_a_long_one_cut() -> None:
    secrets = ("tok3n", "")
    for reason, shown in [
        ("tok3", "tok3"),
        ("tok3n", "[redacted]"),
        ("a tok3n b", "a [redacted] b"),
        ("x" * (MAX_VALUE_CHARS + 5), None),
    ]:
        made = action_line(
            "s", secrets, "call", None, None, "root", "t", "stub", reason, "c", {}, None, None
        )
        line = ActionLine.model_validate_json(made)
        if shown is None:
            assert line.reason.startswith("x" * MAX_VALUE_CHARS + "[... 5 chars cut; sha256 ")
        else:
            assert line.reason == shown


@pytest.mark.parametrize(
    "bad",
    [{"decision": "maybe"}, {"session": 5}, {"arguments": ["a"]}, {"kind": ("finish", None, None)}],
)
def test_a_line_the_model_refuses_is_refused(bad: dict[str, Any]) -> None:
    fields: dict[str, Any] = {
        "session": "root", "tool": "t", "decision": "allow", "reason": "r", "category": "c",
        "arguments": {}, "duration_ms": None, "detail": None, "kind": ("call", None, None),
    }  # fmt: skip
    with pytest.raises(ValidationError):
        _fast("s", ("tok",), {**fields, **bad})
