"""What the guard's tests share about its action log: one line of a call answered
inside the guard (`ActionLog.write`) with the fields a test does not look at filled
in, so each test names only what it is about; the fields of an egress request's start
line (`ActionLog.begin`) but its tool and arguments. A helper, not a test module, so
no test file imports another."""

from __future__ import annotations

from typing import Any

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
