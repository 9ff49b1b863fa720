"""The judged call's pure parts: the stub result and the annotations as the server sent them."""

from __future__ import annotations

import jsonschema

from sandbox import policy
from sandbox.guard.mcp.calls import annotations_of, stub_result
from tests.guard.mcp.mcpparts import SCHEMAS


def test_stub_result_is_a_successful_call_tool_result() -> None:
    schema = SCHEMAS[0]
    result, valid = stub_result(
        "write_file", "the server does not mark this tool read-only", schema
    )
    assert result["isError"] is False and valid is True
    text = policy.stub_reply("write_file", "the server does not mark this tool read-only")
    assert result["content"] == [{"type": "text", "text": text}]
    jsonschema.validate(result["structuredContent"], schema)
    plain, none = stub_result("notify", "r", None)
    assert none is None and "structuredContent" not in plain


def test_annotations_are_taken_raw_so_a_string_true_is_not_read_only() -> None:
    listed = {"name": "t", "annotations": {"readOnlyHint": "true"}}
    annotations = annotations_of(listed)
    assert annotations == {"readOnlyHint": "true"}
    verdict = policy.decide_mcp(annotations, listed=True)
    assert verdict.decision is policy.Decision.STUB
    assert annotations_of({"name": "t"}) is None and annotations_of(None) is None
    allowed = policy.decide_mcp(
        annotations_of({"annotations": {"readOnlyHint": True}}), listed=True
    )
    assert allowed.decision is policy.Decision.ALLOW
