"""`--follow`'s printer: plain lines, JSON lines, the terminal display; never raw control text."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime

from sandbox.contracts.events import RunEvent
from sandbox.progress import FollowPrinter, event_line


def _event(**fields: object) -> RunEvent:
    base: dict[str, object] = {"kind": "action", "time": datetime.now(UTC), "run_id": "test-x"}
    return RunEvent.model_validate(base | fields)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_hostile_tool_name_and_reason_are_escaped() -> None:
    line = event_line(
        _event(step_id="s\x1b]0;t\x07", decision="stub", tool="\x1b[2Jevil", reason="a\u202eb\nc")
    )
    assert "\x1b" not in line and "\x07" not in line and "\u202e" not in line and "\n" not in line
    assert "\\x1b[2Jevil" in line and "\\u202e" in line


def test_plain_lines_name_the_step_its_place_and_the_decision() -> None:
    out = io.StringIO()
    printer = FollowPrinter.for_stream(out, as_json=False)
    assert printer.mode == "plain"
    printer(_event(kind="step_start", step_id="pick", index=1, total=3))
    printer(
        _event(step_id="pick", index=1, total=3, decision="stub", tool="notify_user", reason="r")
    )
    printer(
        _event(kind="step_end", step_id="pick", index=1, total=3, status="passed", duration_s=1.25)
    )
    printer.close()
    assert out.getvalue().splitlines() == [
        "[1/3 pick] step started",
        "[1/3 pick] stub     notify_user: r",
        "[1/3 pick] step passed (1.2 s)",
    ]


def test_json_lines_are_events() -> None:
    out = io.StringIO()
    printer = FollowPrinter.for_stream(out, as_json=True)
    printer(_event(step_id="pick", decision="stub", tool="\x1b[31m"))
    (line,) = out.getvalue().splitlines()
    assert "\x1b" not in line  # JSON escapes control characters itself
    assert RunEvent.model_validate(json.loads(line)).tool == "\x1b[31m"


def test_on_a_terminal_the_lines_print_above_a_progress_line() -> None:
    out = _Tty()
    printer = FollowPrinter.for_stream(out, as_json=False)
    assert printer.mode == "live"
    printer(_event(kind="step_start", step_id="pick"))
    printer(_event(step_id="pick", decision="stub", tool="\x1b[2Jnotify_user"))
    assert "1 call(s), 1 stubbed" in printer.status_text()
    printer.close()
    text = out.getvalue()
    assert "[pick] step started" in text and "\\x1b[2Jnotify_user" in text
    assert "\x1b[2J" not in text


def test_a_fleet_runs_placement_and_runner_phases_print_as_lines() -> None:
    out = io.StringIO()
    printer = FollowPrinter.for_stream(out, as_json=False)
    printer(_event(kind="runner", run_id="", step_id="pick", phase="Pending"))
    printer(_event(kind="placed", run_id="", step_id="pick", node="127.0.0.2\x1b[2J"))
    printer(_event(kind="runner", step_id="pick", phase="Running", node="127.0.0.2"))
    printer.close()
    assert out.getvalue().splitlines() == [
        "[pick] runner Pending",
        "[pick] placed on node 127.0.0.2\\x1b[2J",
        "[pick] runner Running on 127.0.0.2",
    ]
