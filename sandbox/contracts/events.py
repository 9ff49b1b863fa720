"""Live progress of a test run: the events `--follow` prints and the API's callback gets.

One model for every event, so the CLI's plain lines, its JSON lines and a Python
caller read the same facts. An `action` event is one line of the guard's action log
as the runner read it back while the step ran (the guard wrote it before it
answered the call); its text fields came from inside the sandbox, so whoever prints
them makes them terminal-safe (`sandbox.termsafe`). Events are progress, not the
record: the record is written whatever a callback does.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

EventKind = Literal["workflow_start", "step_start", "action", "step_end", "workflow_end"]
REASON_CHARS = 160  # an action event's reason is cut to this many characters


class RunEvent(BaseModel):
    """One thing that happened, as it happened."""

    # Built at its first event: a run without a listener (`--follow`, `on_event`) makes none.
    model_config = ConfigDict(defer_build=True)

    kind: EventKind
    time: datetime
    run_id: str
    step_id: str = ""
    index: int | None = None  # the step's place in a chain (1-based)
    total: int | None = None  # how many steps the chain runs
    # action
    decision: str = ""
    tool: str = ""
    reason: str = ""
    # step_end / workflow_end
    status: str = ""
    duration_s: float | None = None


EventCallback = Callable[[RunEvent], None]
