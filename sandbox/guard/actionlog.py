"""`test_mode_actions.jsonl`: one line per guarded call, on disk before the reply.

Lines are appended with one `write(2)` each on an O_APPEND descriptor (so a
line is never interleaved or half-visible after a crash of the guard) and,
by default, `fdatasync`ed. Secrets are redacted: argument keys that name a
credential, and any occurrence of this run's own tokens.
"""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime
from typing import Any

from sandbox.wire import ActionLine

REDACTED = "[redacted]"
_SECRET_KEY = re.compile(
    r"(pass(word|wd)?|secret|token|api[_-]?key|auth(orization)?|cookie|credential|private[_-]?key)",
    re.IGNORECASE,
)
MAX_VALUE_CHARS = 2000


def redact(value: Any, secrets: tuple[str, ...] = (), depth: int = 0) -> Any:
    """A copy of `value` safe to write down: credential keys and known secrets masked."""
    if depth > 20:
        return "[too deep]"
    if isinstance(value, dict):
        return {
            str(k): REDACTED if _SECRET_KEY.search(str(k)) else redact(v, secrets, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v, secrets, depth + 1) for v in value]
    if isinstance(value, str):
        for secret in secrets:
            if secret:
                value = value.replace(secret, REDACTED)
        if len(value) > MAX_VALUE_CHARS:
            return value[:MAX_VALUE_CHARS] + f"[... {len(value) - MAX_VALUE_CHARS} chars cut]"
        return value
    if value is None or isinstance(value, bool | int | float):
        return value
    return redact(str(value), secrets, depth + 1)


class ActionLog:
    def __init__(self, path: str, *, secrets: tuple[str, ...], fsync_each: bool = True) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        self._secrets = secrets
        self._fsync_each = fsync_each

    def write(
        self,
        *,
        session: str,
        tool: str,
        decision: str,
        reason: str,
        category: str,
        arguments: dict[str, Any],
        duration_ms: float | None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        line = ActionLine(
            time=datetime.now(UTC),
            session=session,
            tool=tool[:200],
            decision=decision,  # type: ignore[arg-type]
            reason=reason,
            category=category,
            arguments=redact(arguments, self._secrets),
            duration_ms=None if duration_ms is None else round(duration_ms, 3),
            detail=redact(detail or {}, self._secrets),
        )
        data = (line.model_dump_json() + "\n").encode()
        os.write(self._fd, data)
        if self._fsync_each:
            os.fdatasync(self._fd)

    def close(self) -> None:
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
