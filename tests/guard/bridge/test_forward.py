"""The body the guard sends the real bridge is the `UpstreamCall` model's, byte for byte."""

from __future__ import annotations

from typing import Any

import pytest

from sandbox.contracts.wire import ToolCall, UpstreamCall
from sandbox.guard.bridge.forward import upstream_body

CALLS = [
    rb'{"tool": "generate_text_llm", "arguments": {"prompt": "bench"}}',
    rb'{"tool": "t", "arguments": {}}',
    # what the step may send: NaN and infinity, non-ASCII and escapes, deep and big values
    rb'{"tool": "t\u00e9", "arguments": {"x": NaN, "y": 1e400, "z": "\u00e9\ud83d\ude00 \"q\"\n",'
    rb' "w": [1, 2.5, null, true, {"a": {}}], "big": 123456789012345678901234567890,'
    rb' "metadata": {"run_id": "forged", "n": -0.0}}}',
]


@pytest.mark.parametrize("raw", CALLS)
def test_the_upstream_body_is_the_models_json(raw: bytes) -> None:
    call = ToolCall.model_validate_json(raw)
    fields: dict[str, Any] = {
        "tool": call.tool,
        "arguments": call.arguments,
        "run_id": "test-x",
        "session": "s-\u00e9",
        "workflow": "wf",
        "step": "s",
    }
    assert upstream_body(**fields) == UpstreamCall(**fields).model_dump_json().encode()
