"""The wire models' bytes: `json_of` is the models' own JSON, byte for byte."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel

from sandbox.contracts.recording import IndexLine
from sandbox.contracts.wire import ToolReply, ToolResult, json_of, reply_json

ODD_DATA = {
    "text": 'naïve 中文 \u2028 \x00 "quoted" \\ </script>',
    "nan": math.nan,
    "inf": [math.inf, -math.inf],
    "big": 2**80,
    "nested": {"list": [1, 2.5, None, True, "é"]},
}


@pytest.mark.parametrize(
    "model",
    [
        ToolResult(text="plain"),
        ToolResult(text="ünïcode ✓", data=ODD_DATA, is_error=True),
        ToolReply(
            ok=True,
            tool="generate_text_llm",
            session="root",
            decision="allow",
            reason="model calls are allowed",
            result=ToolResult(text="x", data=ODD_DATA),
        ),
        IndexLine(
            key="a" * 64, kind="bridge", what="bridge ✓", kept=True, bytes=3, sha256="b" * 64
        ),
    ],
)
def test_json_of_is_the_models_own_json(model: BaseModel) -> None:
    assert json_of(model) == model.model_dump_json().encode()


@pytest.mark.parametrize(
    "result",
    [
        ToolResult(),
        ToolResult(text="ünïcode ✓ \u2028", data=ODD_DATA, is_error=True),
        ToolResult.model_validate_json(b'{"text":"t","data":[1e16,0.1,-0.0],"extra":1}'),
    ],
)
@pytest.mark.parametrize("decision", ["allow", "redirect"])
def test_reply_json_is_the_reply_model_s_json(result: ToolResult, decision: str) -> None:
    fields = {
        "ok": not result.is_error,
        "tool": "tëxt_tool",
        "session": "root.1",
        "decision": decision,
        "reason": 'said "yes"\n',
        "result": result,
    }
    assert reply_json(**fields) == ToolReply.model_validate(fields).model_dump_json().encode()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "result",
    [
        ToolResult(),
        ToolResult(text="ünïcode ✓ \u2028", data=ODD_DATA, is_error=True),
        ToolResult.model_validate_json(b'{"text":"t","data":[1e16,0.1,-0.0],"extra":1}'),
    ],
)
def test_reply_json_with_its_result_s_json_made_already_is_the_same(result: ToolResult) -> None:
    """A forwarded answer's JSON, made for its recording, placed in the reply as it is:
    the reply model's bytes all the same."""
    fields = {
        "ok": not result.is_error,
        "tool": "tëxt_tool",
        "session": "root.1",
        "decision": "allow",
        "reason": 'said "yes"\n',
        "result": result,
    }
    expected = ToolReply.model_validate(fields).model_dump_json().encode()
    assert reply_json(**fields, result_json=json_of(result)) == expected  # type: ignore[arg-type]
