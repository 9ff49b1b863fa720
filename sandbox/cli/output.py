"""How the CLI speaks: terminal-safe lines, JSON lines, and errors.

Text mode: every line goes through `say` (control characters escaped: a record's text
came from inside the sandbox). JSON mode (`--json`): stdout is JSON lines, every line
(the last too) one complete object, and an error is one object on stderr,
`{"error": {"kind": KIND, "message": TEXT}}`, KIND the exit code's name
(`sandbox.contracts.exitcodes`). Nothing here imports pydantic: models are dumped by
the methods they bring.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sandbox.contracts.exitcodes import ExitCode
from sandbox.termsafe import clean

if TYPE_CHECKING:
    from sandbox.contracts.workflow_record import AnyRecord


class _Dumps(Protocol):
    def model_dump_json(self, *, indent: int | None = None) -> str: ...


def say(text: str = "", *, err: bool = False) -> None:
    """Every text line the CLI prints goes through here: control characters escaped."""
    print(clean(text), file=sys.stderr if err else sys.stdout)


def say_line(text: str, *, err: bool = False) -> None:
    """`say` for one line of text that must stay one line (newlines escaped too)."""
    say(clean(text, keep_newlines=False), err=err)


def emit(obj: _Dumps | dict[str, Any]) -> None:
    """One JSON-lines object on stdout (JSON escapes every control character itself)."""
    if isinstance(obj, dict):
        line = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=str)
    else:
        line = obj.model_dump_json()
    print(line, file=sys.stdout)


def error(code: ExitCode, message: str, *, as_json: bool, prefix: str = "error") -> None:
    """An error the user can act on, as one line of text or one JSON object on stderr."""
    text = clean(message, keep_newlines=False)
    if as_json:
        body = {"error": {"kind": code.kind, "message": text}}
        print(json.dumps(body, ensure_ascii=False, separators=(",", ":")), file=sys.stderr)
    else:
        say(f"sandbox: {prefix}: {text}", err=True)


def print_record(record: AnyRecord, as_json: bool) -> None:
    """A run's record: one JSON line, or its summary lines and where it is."""
    if as_json:
        emit(record)
        return
    from sandbox.contracts.record import TestRunRecord

    run_root = Path(record.workflow_dir) / "runs" / record.id
    if not isinstance(record, TestRunRecord):  # a workflow run's record (AnyRecord)
        for line in record.summary_lines():
            say_line(line)
        say(f"record: {run_root / 'test_mode.json'}")
        return
    from sandbox.verify.effects import effect_lines

    for line in record.summary_lines() + effect_lines(record):
        say_line(line)
    say(f"record: {run_root / 'test_mode.json'}")
    if record.stdout.text:
        say("--- stdout (tail) ---")
        say(record.stdout.text.rstrip())
    if record.stderr.text:
        say("--- stderr (tail) ---")
        say(record.stderr.text.rstrip())
