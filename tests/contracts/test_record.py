"""The published JSON Schema of test_mode.json is what the model produces."""

from __future__ import annotations

import json

from sandbox.contracts.record import SCHEMA_PATH, record_json_schema


def test_committed_schema_matches_the_model() -> None:
    assert SCHEMA_PATH.read_text() == record_json_schema(), (
        "regenerate with: python -c 'from sandbox.contracts.record import *; "
        "SCHEMA_PATH.write_text(record_json_schema())'"
    )


def test_schema_names_the_statuses_builder_and_pulse_rely_on() -> None:
    schema = json.loads(record_json_schema())
    statuses = set(schema["$defs"]["RunStatus"]["enum"])
    assert {"passed", "failed", "timeout", "refused", "error", "killed"} <= statuses
