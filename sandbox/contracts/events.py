"""Live progress of a test run: the events `--follow` prints and the API's callback gets.

One model for every event, so the CLI's plain lines, its JSON lines and a Python
caller read the same facts. An `action` event is one line of the guard's action log
as the runner read it back while the step ran (the guard wrote it before it
answered the call); its text fields came from inside the sandbox, so whoever prints
them makes them terminal-safe (`sandbox.termsafe`). Events are progress, not the
record: the record is written whatever a callback does. `sandbox run --follow --json`
prints one event per line; its published JSON Schema is
`sandbox/contracts/events.schema.json` (`events_json_schema`, pinned by a test).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EventKind = Literal[
    "workflow_start", "step_start", "action", "step_end", "workflow_end", "placed", "runner"
]
REASON_CHARS = 160  # an action event's reason is cut to this many characters


class RunEvent(BaseModel):
    """One thing that happened, as it happened."""

    # Built at its first event: a run without a listener (`--follow`, `on_event`) makes none.
    model_config = ConfigDict(defer_build=True, title="RunEvent")

    kind: EventKind = Field(
        description="What happened; a chain's events are bracketed by "
        "workflow_start and workflow_end; `placed` and `runner` come from the "
        "controller of a run the cluster's scheduler places (the node it landed "
        "on, the runner Pod's phase)"
    )
    time: datetime = Field(description="When the runner saw it (UTC)")
    run_id: str = Field(
        description="The test run (the chain's run for a chain); empty in `placed` and "
        "`runner` events before the runner named its run"
    )
    step_id: str = Field(
        default="", description="The step it belongs to; empty for a chain's own events"
    )
    index: int | None = Field(default=None, description="The step's place in a chain (1-based)")
    total: int | None = Field(default=None, description="How many steps the chain runs")
    decision: str = Field(
        default="", description="action: the guard's decision: allow, stub, redirect or refuse"
    )
    tool: str = Field(
        default="",
        description="action: the tool, host or server called (from inside "
        "the sandbox: print it terminal-safe)",
    )
    reason: str = Field(default="", description=f"action: why, cut to {REASON_CHARS} characters")
    status: str = Field(
        default="", description="step_end, workflow_end: the run status it ended with"
    )
    duration_s: float | None = Field(
        default=None, description="step_end, workflow_end: how long it took (seconds)"
    )
    node: str = Field(default="", description="placed, runner: the node the runner's Pod is on")
    phase: str = Field(
        default="",
        description="runner: the runner Pod's phase (Pending, Running, Succeeded, Failed)",
    )


SCHEMA_PATH = Path(__file__).resolve().parent / "events.schema.json"


def events_json_schema() -> str:
    """The published schema of one `--follow --json` line; a test pins the committed file."""
    return json.dumps(RunEvent.model_json_schema(), indent=2, sort_keys=True) + "\n"


EventCallback = Callable[[RunEvent], None]
