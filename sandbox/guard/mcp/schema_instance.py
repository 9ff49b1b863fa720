"""A JSON-Schema instance for a stubbed MCP call's `structuredContent`.

The SDK's client rejects a successful `CallToolResult` whose tool declares an
`outputSchema` but carries no valid `structuredContent`, so a stub needs the
smallest plausible value that validates. Pure; its limits are in mcp.spec.md."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from typing import Any

from jsonschema import exceptions as jsonschema_exceptions
from jsonschema.validators import validator_for
from referencing import Registry

STUB_STRING = "TEST MODE: not run"
MAX_DEPTH = 24
SUCCESS_KEYS = frozenset({"success", "succeeded", "ok", "done"})

_FORMAT_SAMPLES = {
    "date-time": "1970-01-01T00:00:00Z",
    "date": "1970-01-01",
    "time": "00:00:00Z",
    "duration": "PT0S",
    "email": "test-mode@example.invalid",
    "idn-email": "test-mode@example.invalid",
    "hostname": "example.invalid",
    "idn-hostname": "example.invalid",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
    "uri": "https://example.invalid/test-mode",
    "uri-reference": "https://example.invalid/test-mode",
    "iri": "https://example.invalid/test-mode",
    "iri-reference": "https://example.invalid/test-mode",
    "url": "https://example.invalid/test-mode",
    "uuid": "00000000-0000-0000-0000-000000000000",
    "json-pointer": "",
    "regex": ".*",
}


def is_valid(schema: Mapping[str, Any], instance: Any) -> bool:
    """Does `instance` validate against `schema` (local `$ref`s only)?"""
    try:
        cls = validator_for(schema)
        validator = cls(schema, registry=Registry())
        error = jsonschema_exceptions.best_match(validator.iter_errors(instance))
    except Exception:  # an invalid schema or an unresolvable $ref: not valid
        return False
    return error is None


def valid_instance(schema: Mapping[str, Any]) -> tuple[Any, bool]:
    """The first candidate instance that validates, and whether one did."""
    first: Any = None
    for index, candidate in enumerate(_candidates(schema, schema, 0)):
        if index == 0:
            first = candidate
        if is_valid(schema, candidate):
            return candidate, True
        if index >= 16:
            break
    return first, False


def instance_for(schema: Mapping[str, Any]) -> Any:
    """The first (best-guess) instance for `schema`, validated or not."""
    return next(_candidates(schema, schema, 0), None)


def _resolve(root: Mapping[str, Any], ref: str) -> Mapping[str, Any] | None:
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref.lstrip("#").split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, Mapping) else None


def _candidates(schema: Any, root: Mapping[str, Any], depth: int) -> Iterator[Any]:
    """Instances for `schema`, best guess first."""
    if schema is True or not isinstance(schema, Mapping):
        yield {}
        return
    if depth > MAX_DEPTH:
        yield None
        return
    if isinstance(schema.get("$ref"), str):
        target = _resolve(root, schema["$ref"])
        if target is not None:
            merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
            yield from _candidates(merged, root, depth + 1)
            return
    if "const" in schema:
        yield copy.deepcopy(schema["const"])
        return
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        for value in schema["enum"]:
            yield copy.deepcopy(value)
        return
    for key in ("examples",):
        if isinstance(schema.get(key), list):
            for value in schema[key]:
                yield copy.deepcopy(value)
    if "default" in schema:
        yield copy.deepcopy(schema["default"])
    if isinstance(schema.get("allOf"), list) and schema["allOf"]:
        merged_all: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            if isinstance(part, Mapping):
                part = _resolve(root, part["$ref"]) if isinstance(part.get("$ref"), str) else part
                if part is None:
                    continue
                for key, value in part.items():
                    if key == "properties" and isinstance(value, Mapping):
                        merged_all["properties"] = {**merged_all.get("properties", {}), **value}
                    elif key == "required" and isinstance(value, list):
                        merged_all["required"] = [*merged_all.get("required", []), *value]
                    else:
                        merged_all.setdefault(key, value)
        yield from _candidates(merged_all, root, depth + 1)
        return
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
            for option in schema[key]:
                if isinstance(option, Mapping):
                    yield from _candidates({**rest, **option}, root, depth + 1)
            return
    types = schema.get("type")
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list) or not types:
        types = _implied_types(schema)
    for kind in types:
        yield from _by_type(str(kind), schema, root, depth)


def _implied_types(schema: Mapping[str, Any]) -> list[str]:
    if any(k in schema for k in ("properties", "required", "additionalProperties")):
        return ["object"]
    if any(k in schema for k in ("items", "prefixItems", "minItems")):
        return ["array"]
    if any(k in schema for k in ("minLength", "maxLength", "pattern", "format")):
        return ["string"]
    if any(k in schema for k in ("minimum", "maximum", "multipleOf")):
        return ["number"]
    return ["object", "null", "string"]


def _by_type(
    kind: str, schema: Mapping[str, Any], root: Mapping[str, Any], depth: int
) -> Iterator[Any]:
    if kind == "null":
        yield None
    elif kind == "boolean":
        yield False
        yield True
    elif kind in ("integer", "number"):
        yield _number(schema, integer=kind == "integer")
    elif kind == "string":
        yield from _strings(schema)
    elif kind == "array":
        yield _array(schema, root, depth)
    elif kind == "object":
        yield _object(schema, root, depth, only_required=True)
        yield _object(schema, root, depth, only_required=False)


def _number(schema: Mapping[str, Any], *, integer: bool) -> int | float:
    def bound(key: str) -> float | None:
        value = schema.get(key)
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    nudge = 1 if integer else 0.5
    low, high = bound("minimum"), bound("maximum")
    exclusive_low, exclusive_high = bound("exclusiveMinimum"), bound("exclusiveMaximum")
    value: float = 0 if low is None else max(0, low)
    if high is not None and value > high:
        value = high
    if exclusive_low is not None and value <= exclusive_low:
        value = exclusive_low + nudge
    if exclusive_high is not None and value >= exclusive_high:
        value = exclusive_high - nudge
    step = bound("multipleOf")
    if step is not None and step > 0:
        value = step * math.ceil(value / step)
    if integer or float(value).is_integer():
        return math.ceil(value) if integer else int(value)
    return value


def _strings(schema: Mapping[str, Any]) -> Iterator[str]:
    fmt = schema.get("format")
    min_length = schema.get("minLength", 0)
    max_length = schema.get("maxLength")
    min_length = min_length if isinstance(min_length, int) else 0
    if isinstance(fmt, str) and fmt in _FORMAT_SAMPLES:
        yield _FORMAT_SAMPLES[fmt]
    text = STUB_STRING
    if isinstance(max_length, int) and len(text) > max_length:
        text = text[:max_length]
    if len(text) < min_length:
        text = text + "x" * (min_length - len(text))
    yield text
    yield "x" * min_length


def _array(schema: Mapping[str, Any], root: Mapping[str, Any], depth: int) -> list[Any]:
    min_items = schema.get("minItems", 0)
    min_items = min_items if isinstance(min_items, int) and min_items > 0 else 0
    prefix = schema.get("prefixItems")
    items = schema.get("items")
    out: list[Any] = []
    if isinstance(prefix, list):
        for part in prefix[:min_items]:
            out.append(next(_candidates(part, root, depth + 1), None))
    elif isinstance(items, list):  # draft 4-7 tuple form
        for part in items[:min_items]:
            out.append(next(_candidates(part, root, depth + 1), None))
    while len(out) < min_items:
        item_schema = items if isinstance(items, Mapping | bool) else {}
        out.append(next(_candidates(item_schema, root, depth + 1), None))
    return out


def _object(
    schema: Mapping[str, Any], root: Mapping[str, Any], depth: int, *, only_required: bool
) -> dict[str, Any]:
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = schema.get("required")
    names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
    if not only_required:
        names += [n for n in properties if n not in names]
    out: dict[str, Any] = {}
    for name in names:
        value = next(_candidates(properties.get(name, {}), root, depth + 1), None)
        if value is False and name.lower() in SUCCESS_KEYS:
            value = True  # a stub tells the agent to continue as if the call succeeded
        out[name] = value
    min_properties = schema.get("minProperties")
    if isinstance(min_properties, int):
        for name in properties:
            if len(out) >= min_properties:
                break
            out.setdefault(name, next(_candidates(properties[name], root, depth + 1), None))
    return out
