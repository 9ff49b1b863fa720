"""The published JSON Schema of a `--follow --json` line is what the event model produces,
and every field says what it means (an integrator in another language reads only it)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import jsonschema

from sandbox.contracts.events import SCHEMA_PATH, RunEvent, events_json_schema


def test_committed_events_schema_matches_the_model() -> None:
    assert SCHEMA_PATH.read_text() == events_json_schema(), (
        "regenerate with: python -c 'from sandbox.contracts.events import *; "
        "SCHEMA_PATH.write_text(events_json_schema())'"
    )


def test_every_event_property_is_described_and_an_event_line_validates() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    assert set(schema["properties"]) == set(RunEvent.model_fields)
    assert [p for p, s in schema["properties"].items() if not s.get("description")] == []
    line = RunEvent(
        kind="action", time=datetime.now(UTC), run_id="test-1", decision="stub", tool="t"
    ).model_dump_json()
    jsonschema.validate(json.loads(line), schema)
