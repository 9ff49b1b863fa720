"""`--follow`: a run's events as they happen, on a terminal, in a pipe, or as JSON lines.

Three shapes of the same `RunEvent`s: on a terminal a one-line progress display
(`rich`) under the lines already printed; in a pipe or a file plain lines, one per
event; with `--json` one JSON object per line. Every text that came from inside the
sandbox (tool names, reasons) goes through `sandbox.termsafe.clean` before it is
printed, so a hostile step cannot drive the user's terminal. Events arrive on the
runner's threads; one lock keeps lines whole.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Literal, TextIO

from sandbox.contracts.events import RunEvent
from sandbox.termsafe import clean

Mode = Literal["live", "plain", "json"]


def _where(event: RunEvent) -> str:
    place = f"{event.index}/{event.total} " if event.index and event.total else ""
    return f"[{place}{clean(event.step_id, keep_newlines=False)}]"


def event_line(event: RunEvent) -> str:
    """The plain line of one event (terminal-safe)."""
    if event.kind == "action":
        tool = clean(event.tool, keep_newlines=False)
        reason = clean(event.reason, keep_newlines=False)
        return f"{_where(event)} {event.decision:<8} {tool}" + (f": {reason}" if reason else "")
    if event.kind == "step_start":
        return f"{_where(event)} step started"
    if event.kind == "step_end":
        took = f" ({event.duration_s:.1f} s)" if event.duration_s is not None else ""
        return f"{_where(event)} step {event.status}{took}"
    if event.kind == "placed":
        return f"{_where(event)} placed on node {clean(event.node, keep_newlines=False)}"
    if event.kind == "runner":
        node = clean(event.node, keep_newlines=False)
        return f"{_where(event)} runner {clean(event.phase, keep_newlines=False)}" + (
            f" on {node}" if node else ""
        )
    if event.kind == "workflow_start":
        return f"workflow test run {event.run_id}: {event.total} step(s)"
    took = f" ({event.duration_s:.1f} s)" if event.duration_s is not None else ""
    return f"workflow test run {event.run_id}: {event.status}{took}"


class FollowPrinter:
    """The callback `--follow` hands the API; `close()` once the run ended."""

    def __init__(self, mode: Mode, out: TextIO | None = None) -> None:
        self.mode = mode
        self.out = out or sys.stdout
        self._lock = threading.Lock()
        self._live: Any = None
        self._step = ""
        self._calls = 0
        self._stubbed = 0
        self._started = time.monotonic()
        if mode == "live":
            from rich.console import Console
            from rich.live import Live

            self._console = Console(file=self.out, highlight=False, markup=False, emoji=False)
            self._live = Live(
                _StatusLine(self), console=self._console, transient=True, refresh_per_second=4
            )
            self._live.start()

    @classmethod
    def for_stream(cls, out: TextIO, *, as_json: bool) -> FollowPrinter:
        """JSON lines with `--json`; the live display on a terminal; plain lines else."""
        if as_json:
            return cls("json", out)
        return cls("live" if out.isatty() else "plain", out)

    def __call__(self, event: RunEvent) -> None:
        with self._lock:
            if self.mode == "json":
                self.out.write(event.model_dump_json() + "\n")
                self.out.flush()
                return
            self._track(event)
            line = event_line(event)
            if self._live is not None:
                from rich.text import Text

                self._console.print(Text(line))
            else:
                self.out.write(line + "\n")
                self.out.flush()

    def _track(self, event: RunEvent) -> None:
        if event.kind == "step_start":
            self._step = event_line(event).split("]")[0] + "]"
            self._calls = self._stubbed = 0
        elif event.kind == "action":
            self._calls += 1
            self._stubbed += event.decision == "stub"

    def status_text(self) -> str:
        """The one-line progress display: where the run is, its calls, its time."""
        took = time.monotonic() - self._started
        return (
            f"{self._step or 'starting'} {self._calls} call(s), {self._stubbed} stubbed, "
            f"{took:.0f} s"
        )

    def close(self) -> None:
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None


class _StatusLine:
    """Rendered at each refresh, so the elapsed time moves while nothing is logged."""

    def __init__(self, printer: FollowPrinter) -> None:
        self._printer = printer

    def __rich__(self) -> Any:
        from rich.text import Text

        return Text(self._printer.status_text(), style="dim")
