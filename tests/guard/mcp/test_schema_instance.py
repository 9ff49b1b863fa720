"""Stub structured content: instances generated for the output schemas servers declare."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from sandbox.guard.mcp.schema_instance import instance_for, is_valid, valid_instance
from tests.guard.mcp.mcpparts import SCHEMAS


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_generated_instances_validate(schema: dict[str, Any]) -> None:
    instance, valid = valid_instance(schema)
    if "pattern" in json.dumps(schema):
        assert not valid  # a pattern is not solved; the caller records it
        return
    assert valid, instance
    jsonschema.validate(instance, schema)


def test_stub_success_fields_read_as_success() -> None:
    schema = {
        "type": "object",
        "properties": {"success": {"type": "boolean"}},
        "required": ["success"],
    }
    assert instance_for(schema) == {"success": True}
    assert is_valid(schema, {"success": True})
    assert not is_valid({"type": "object", "$ref": "#/nowhere"}, {})
