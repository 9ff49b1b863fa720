"""Stub structured content: instances generated for the output schemas servers declare."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from sandbox.guard.mcp.schema_instance import instance_for, is_valid, valid_instance

# Output schemas as real servers declare them (filesystem, memory, time), and the
# JSON-Schema features a server may use.
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"content": {"type": "string"}},
        "required": ["content"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "entities": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "observations": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["name", "observations"],
                },
            },
            "relations": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["entities", "relations"],
    },
    {
        "$defs": {
            "TimeResult": {
                "type": "object",
                "properties": {
                    "timezone": {"type": "string"},
                    "datetime": {"type": "string", "format": "date-time"},
                    "is_dst": {"type": "boolean"},
                },
                "required": ["timezone", "datetime", "is_dst"],
            }
        },
        "type": "object",
        "properties": {
            "source": {"$ref": "#/$defs/TimeResult"},
            "target": {"$ref": "#/$defs/TimeResult"},
        },
        "required": ["source", "target"],
    },
    {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 3, "maximum": 9, "multipleOf": 3},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "status": {"enum": ["queued", "sent"]},
            "kind": {"const": "proposal"},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
            "id": {"type": "string", "format": "uuid"},
            "code": {"type": "string", "minLength": 25, "maxLength": 30},
            "maybe": {"type": ["null", "string"]},
            "either": {"oneOf": [{"type": "integer", "minimum": 5}, {"type": "string"}]},
            "both": {
                "allOf": [
                    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
                ]
            },
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
            "success": {"type": "boolean"},
        },
        "required": [
            "count",
            "ratio",
            "status",
            "kind",
            "tags",
            "id",
            "code",
            "maybe",
            "either",
            "both",
            "pair",
            "success",
        ],
        "additionalProperties": False,
    },
    {"type": "object", "minProperties": 1, "properties": {"x": {"type": "string"}}},
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["code"],
    },
]


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
