"""`test_mode_actions.jsonl`: the guard's record of every guarded call, written by it alone.

Two shapes of entry. A call that is answered inside the guard (a stub, a
refusal, a session) is one line, `event="call"`. A call that is forwarded
(bridge upstream, MCP server, the step's executor, egress) gets a `start` line
before any byte of it leaves the guard (what was asked, the decision, a
`call_id`) and an `outcome` line after (ok or error, duration, sizes), so a
guard that dies mid-call leaves "started, outcome unknown" behind.

Lines are appended with one `write(2)` each on an O_APPEND descriptor (never
interleaved or half-visible after a crash of the guard) and, by default,
`fdatasync`ed before the call goes on. Only the guard's uid can write the file
(the runner makes it 0600, owned by that uid; no other process of the run runs
as it, and it is mounted into no other container).

Sizes are capped so a hostile step or server cannot make the log cost the
host: string values past `MAX_VALUE_CHARS` are cut and hashed, containers past
`MAX_ITEMS` are cut, a line past `MAX_LINE_BYTES` has its arguments replaced by
their size and hash. Past `MAX_LOG_BYTES` the guard writes one `log_full`
marker and from then on stubs every call it would have forwarded (`begin`
raises `LogFull`) instead of forwarding it unlogged; outcomes of calls already
started still go in, from a reserve. At close a second `log_full` line says how
many calls were stubbed unlogged. Secrets are redacted: argument keys that name
a credential, and any occurrence of this run's own tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sandbox.contracts.wire import ActionLine

REDACTED = "[redacted]"
_SECRET_KEY = re.compile(
    r"(pass(word|wd)?|secret|token|api[_-]?key|auth(orization)?|cookie|credential|private[_-]?key)",
    re.IGNORECASE,
)
MAX_VALUE_CHARS = 2000  # one string value; past it: cut, with the whole value's SHA-256
MAX_ITEMS = 200  # entries of one list or object
MAX_LINE_BYTES = 64 * 1024  # one line; past it the arguments become their size and hash
MAX_LOG_BYTES = 48 * 1024 * 1024  # calls stop being forwarded past this
OUTCOME_RESERVE_BYTES = 8 * 1024 * 1024  # outcomes and markers may use this much more
LOG_TOOL = "action-log"


class LogFull(Exception):
    """The log reached its cap: the call must be stubbed, not forwarded unlogged."""


def _full_reason() -> str:
    return (
        f"the action log reached its cap of {MAX_LOG_BYTES // 2**20} MiB, "
        "so no further call is forwarded"
    )


def _digest(data: str) -> str:
    return hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()


def redact(value: Any, secrets: tuple[str, ...] = (), depth: int = 0) -> Any:
    """A copy of `value` safe and small enough to write down: credential keys and known
    secrets masked, long strings cut and hashed, long containers cut."""
    if depth > 20:
        return "[too deep]"
    if isinstance(value, dict):
        items = list(value.items())
        out = {
            str(k): REDACTED if _SECRET_KEY.search(str(k)) else redact(v, secrets, depth + 1)
            for k, v in items[:MAX_ITEMS]
        }
        if len(items) > MAX_ITEMS:
            out["[cut]"] = f"{len(items) - MAX_ITEMS} more keys"
        return out
    if isinstance(value, list | tuple):
        kept = [redact(v, secrets, depth + 1) for v in value[:MAX_ITEMS]]
        if len(value) > MAX_ITEMS:
            kept.append(f"[... {len(value) - MAX_ITEMS} more items cut]")
        return kept
    if isinstance(value, str):
        for secret in secrets:
            if secret:
                value = value.replace(secret, REDACTED)
        if len(value) > MAX_VALUE_CHARS:
            cut = len(value) - MAX_VALUE_CHARS
            return value[:MAX_VALUE_CHARS] + f"[... {cut} chars cut; sha256 {_digest(value)}]"
        return value
    if value is None or isinstance(value, bool | int | float):
        return value
    return redact(str(value), secrets, depth + 1)


def _summarized(value: dict[str, Any]) -> dict[str, Any]:
    """What stands in for arguments or detail too large for one line."""
    text = json.dumps(value, sort_keys=True, default=str)
    return {"[cut]": f"{len(text)} bytes as JSON; sha256 {_digest(text)}"}


@dataclass(frozen=True)
class Started:
    """A forwarded call whose `start` line is on disk; its `outcome` line is still due."""

    call_id: str
    session: str
    tool: str
    decision: str
    reason: str
    category: str
    started: float  # time.perf_counter() at the start line


class ActionLog:
    def __init__(
        self, path: str, *, secrets: tuple[str, ...], fsync_each: bool = True, step: str = ""
    ) -> None:
        self._step = step
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        self._secrets = secrets
        self._fsync_each = fsync_each
        self._bytes = os.fstat(self._fd).st_size
        self._next_call = 0
        self._full = False
        self._unlogged = 0  # calls answered without a line since the log filled
        self._closed = False

    @property
    def full(self) -> bool:
        return self._full

    def check_room(self) -> None:
        """Raise LogFull when the log is already full: a caller about to prepare a
        forwarded call (dial its host) stops before anything happens. Counts nothing:
        the caller's own line for the refusal is the one counted."""
        if self._full:
            raise LogFull(_full_reason())

    # -- one-line decisions --------------------------------------------------------

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
        """A call answered inside the guard (stub, refusal, session): one line.

        Once the log is full the line is not written (the call had no effect
        outside the guard); it is counted in the closing `log_full` line."""
        line = self._line(
            event="call",
            session=session,
            tool=tool,
            decision=decision,
            reason=reason,
            category=category,
            arguments=arguments,
            duration_ms=duration_ms,
            detail=detail,
        )
        if not self._room_for(len(line), reserve=False):
            self._unlogged += 1
            return
        self._append(line)

    # -- forwarded calls -------------------------------------------------------------

    def begin(
        self,
        *,
        session: str,
        tool: str,
        decision: str,
        reason: str,
        category: str,
        arguments: dict[str, Any],
        detail: dict[str, Any] | None = None,
    ) -> Started:
        """The `start` line of a call about to be forwarded, on disk before it returns.

        Raises LogFull when the log has no room: the caller stubs the call."""
        self._next_call += 1
        call_id = f"c{self._next_call}"
        line = self._line(
            event="start",
            call_id=call_id,
            session=session,
            tool=tool,
            decision=decision,
            reason=reason,
            category=category,
            arguments=arguments,
            duration_ms=None,
            detail=detail,
        )
        if not self._room_for(len(line), reserve=False):
            self._unlogged += 1
            raise LogFull(_full_reason())
        self._append(line)
        return Started(call_id, session, tool, decision, reason, category, time.perf_counter())

    def outcome(
        self, call: Started, *, ok: bool, reason: str = "", detail: dict[str, Any] | None = None
    ) -> None:
        """The `outcome` line of a started call: ok or error, its duration, its sizes."""
        line = self._line(
            event="outcome",
            call_id=call.call_id,
            outcome="ok" if ok else "error",
            session=call.session,
            tool=call.tool,
            decision=call.decision,
            reason=reason or call.reason,
            category=call.category,
            arguments={},
            duration_ms=(time.perf_counter() - call.started) * 1000,
            detail=detail,
        )
        if self._room_for(len(line), reserve=True):
            self._append(line)

    # -- the file --------------------------------------------------------------------

    def _line(self, **fields: Any) -> bytes:
        fields["arguments"] = redact(fields["arguments"], self._secrets)
        fields["detail"] = redact(fields["detail"] or {}, self._secrets)
        fields["tool"] = str(fields["tool"])[:200]
        fields["reason"] = redact(str(fields["reason"]), self._secrets)
        if fields["duration_ms"] is not None:
            fields["duration_ms"] = round(fields["duration_ms"], 3)
        line = ActionLine(time=datetime.now(UTC), step=self._step, **fields)
        data = (line.model_dump_json() + "\n").encode()
        if len(data) > MAX_LINE_BYTES:
            line = line.model_copy(
                update={
                    "arguments": _summarized(line.arguments),
                    "detail": _summarized(line.detail),
                }
            )
            data = (line.model_dump_json() + "\n").encode()
        return data

    def _room_for(self, size: int, *, reserve: bool) -> bool:
        """Whether a line of `size` bytes fits; the first refusal writes the marker."""
        if self._closed:
            return False
        limit = MAX_LOG_BYTES + (OUTCOME_RESERVE_BYTES if reserve else 0)
        if not self._full and self._bytes + size > MAX_LOG_BYTES:
            self._full = True
            self._append(self._marker(f"the action log reached its cap of {MAX_LOG_BYTES} bytes"))
        return self._bytes + size <= limit and not (self._full and not reserve)

    def _marker(self, reason: str, detail: dict[str, Any] | None = None) -> bytes:
        line = ActionLine(
            time=datetime.now(UTC),
            step=self._step,
            event="log_full",
            session="guard",
            tool=LOG_TOOL,
            decision="stub",
            reason=reason + "; every later call is stubbed without a line",
            category="log",
            detail=detail or {},
        )
        return (line.model_dump_json() + "\n").encode()

    def _append(self, data: bytes) -> None:
        os.write(self._fd, data)
        self._bytes += len(data)
        if self._fsync_each:
            os.fdatasync(self._fd)

    def close(self) -> None:
        """Flush; when the log filled up, say how many calls went unlogged since."""
        if self._closed:
            return
        try:
            if self._full and self._bytes < MAX_LOG_BYTES + OUTCOME_RESERVE_BYTES:
                self._append(
                    self._marker(
                        "the action log was full",
                        {"stubbed_unlogged": self._unlogged},
                    )
                )
            os.fsync(self._fd)
        finally:
            self._closed = True
            os.close(self._fd)
