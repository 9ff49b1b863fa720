"""What every HTTP entry of the guard does first: check the bearer token, and refuse.

One check and one refusal for the bridge and the MCP endpoints alike: the token is
compared in constant time, and a refused request's action-log line is written
before its answer goes out (fail closed: the effect never happens, the reason is
on disk, the step gets it as `{"error": reason}`).
"""

from __future__ import annotations

import hmac
import time
from typing import TYPE_CHECKING

from sandbox.guard.actionlog import ActionLog

if TYPE_CHECKING:
    from starlette.responses import Response

BAD_TOKEN = "wrong or missing bridge token"


def bearer_ok(given: str | bytes, token: str) -> bool:
    """Whether an `Authorization` header value is exactly `Bearer <token>`."""
    raw = given.encode("latin-1", "replace") if isinstance(given, str) else given
    return hmac.compare_digest(raw, f"Bearer {token}".encode())


async def reject_and_log(
    log: ActionLog, status: int, reason: str, *, tool: str, session: str, started: float
) -> Response:
    """Log the refusal (category `request`), then answer it with `status` (once the line
    is on disk)."""
    # The framework's response only here: the guard serves DNS and interception before
    # the web stack is imported (`sandbox.guard.startup`).
    from starlette.responses import JSONResponse

    await log.write(
        session=session,
        tool=tool,
        decision="refuse",
        reason=reason,
        category="request",
        arguments={},
        duration_ms=(time.perf_counter() - started) * 1000,
    )
    return JSONResponse({"error": reason}, status_code=status)
