"""An action log as the guard writes it (its own writer), for the tests that need a
finished run's log: a helper, not a test module, so no test file imports another."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sandbox.guard.actionlog import ActionLog
from sandbox.policy import UNKNOWN_REASON


def write_log(path: Path, calls: list[tuple[str, str, dict[str, Any]]]) -> None:
    """The calls as the guard logs them: (tool, decision, arguments), one line each."""
    path.touch()
    log = ActionLog(str(path), secrets=())

    async def write_all() -> None:
        for tool, decision, arguments in calls:
            await log.write(
                session="root",
                tool=tool,
                decision=decision,
                reason=UNKNOWN_REASON if decision == "stub" else "runs against the copy",
                category="unknown" if decision == "stub" else "workflow_db",
                arguments=arguments,
                duration_ms=0.1,
            )

    asyncio.run(write_all())
    log.close()
