"""What the guard's tests share about its action log: one line of a call answered
inside the guard (`ActionLog.write`) with the fields a test does not look at filled
in, so each test names only what it is about; the fields of an egress request's start
line (`ActionLog.begin`) but its tool and arguments; one line built as `log` builds
its lines, from named fields; the redaction walk without any fast path, which the
guard's walk and its lines must match byte for byte. A helper, not a test module, so
no test file imports another."""

from __future__ import annotations

import re
from typing import Any

from sandbox.guard.actionline import (
    MAX_DEPTH,
    MAX_ITEMS,
    REDACTED,
    SECRET_WORDS,
    action_line,
    redact_text,
)
from sandbox.guard.actionlog import ActionLog

EGRESS_CALL = {"session": "egress", "decision": "allow", "reason": "r", "category": "egress"}


async def write_line(
    log: ActionLog,
    tool: str,
    *,
    session: str = "root",
    decision: str = "stub",
    reason: str = "r",
    category: str = "test",
    arguments: dict[str, Any] | None = None,
    duration_ms: float | None = 0.0,
    detail: dict[str, Any] | None = None,
) -> None:
    """`log.write` of one answered call: a stub in the root session unless told."""
    await log.write(
        session=session,
        tool=tool,
        decision=decision,
        reason=reason,
        category=category,
        arguments={} if arguments is None else arguments,
        duration_ms=duration_ms,
        detail=detail,
    )


def line_of(
    log: ActionLog,
    *,
    session: Any,
    tool: Any,
    decision: Any,
    reason: Any,
    arguments: Any,
    duration_ms: Any,
    detail: Any,
    category: Any = "",
    event: Any = "call",
    call_id: Any = None,
    outcome: Any = None,
) -> bytes:
    """The line `log` writes for these fields (`action_line` with its step and secrets)."""
    return action_line(
        log._step, log._secrets, event, call_id, outcome, session, tool, decision, reason,
        category, arguments, duration_ms, detail,
    )  # fmt: skip


def full_walk(value: Any, secrets: tuple[str, ...] = (), depth: int = 0) -> Any:
    """The redaction walk without any fast path (every string searched for every
    secret, every key's words searched): what `redact` must write, byte for byte."""
    if depth > MAX_DEPTH:
        return "[too deep]"
    if isinstance(value, str):
        return redact_text(value, secrets)
    if isinstance(value, bool | int | float | type(None)):
        return value
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for n, (k, v) in enumerate(value.items()):
            if n == MAX_ITEMS:
                out["[cut]"] = f"{len(value) - MAX_ITEMS} more keys"
                break
            key = str(k)
            out[key] = REDACTED if re.search(SECRET_WORDS, key, re.I) else None
            if out[key] is None:
                out[key] = full_walk(v, secrets, depth + 1)
        return out
    if isinstance(value, list | tuple):
        kept = [full_walk(v, secrets, depth + 1) for v in value[:MAX_ITEMS]]
        if len(value) > MAX_ITEMS:
            kept.append(f"[... {len(value) - MAX_ITEMS} more items cut]")
        return kept
    return full_walk(str(value), secrets, depth + 1)
