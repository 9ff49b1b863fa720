"""Shared by the job-board step scripts: one bridge call that fails loudly or not at all.

Why: a step must exit 0 when every call came back ok (a test-mode stub is ok:
"continue as if it succeeded") and fail only on a real failure (a refusal, a
tool error, no bridge). Keeping that rule in one place keeps the three steps
honest about it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

try:  # inside the step image
    import agentworks_bridge as bridge
except ImportError:  # pragma: no cover - on a developer host with the sandbox package
    from sandbox.stepside import agentworks_bridge as bridge


class StepFailure(Exception):
    """A call that did not come back ok: the step has really failed."""


def call(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """Call one tool through the bridge; returns the reply, raises StepFailure if not ok."""
    reply = bridge.call(tool, arguments)
    result = reply.get("result") or {}
    if not reply.get("ok") or result.get("is_error"):
        reason = reply.get("reason") or result.get("text") or "no reason given"
        raise StepFailure(f"{tool} failed ({reply.get('decision', '?')}): {reason}")
    decision = reply.get("decision", "?")
    first_line = str(result.get("text", "")).strip().splitlines()[:1]
    print(f"  {tool}: {decision}" + (f" - {first_line[0][:120]}" if first_line else ""))
    return reply


def text(reply: dict[str, Any]) -> str:
    return str((reply.get("result") or {}).get("text", ""))


def rows(reply: dict[str, Any]) -> list[list[Any]]:
    """The rows of a query_workflow_db reply (data = {columns, rows, truncated})."""
    data = (reply.get("result") or {}).get("data") or {}
    found = data.get("rows") if isinstance(data, dict) else None
    return found if isinstance(found, list) else []


def stubbed(reply: dict[str, Any]) -> bool:
    return reply.get("decision") == "stub"


def run(main: Callable[[], None]) -> int:
    """Run a step body; map failures to a clear message and a non-zero exit code."""
    try:
        main()
    except bridge.BridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StepFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
