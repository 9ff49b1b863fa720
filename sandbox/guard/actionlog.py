"""`test_mode_actions.jsonl`: the guard's record of every guarded call, written by it alone.

Guarantees (the full contract is actionlog.spec.md beside this file): a call's line
is written (`write(2)` done on the guard's O_APPEND descriptor) before the call is
forwarded, and its outcome line before its reply leaves, so a guard killed at any
instant leaves every line of every call that had an effect or an answer (the page
cache outlives the process). Lines are synced in group commit off the request path
within SYNC_INTERVAL_S, and at close; the runner syncs once more when it seals the
record. `durability="per-call"` (host.toml) syncs each line before its call goes on
instead. In group commit the loop appends a line itself when nothing is queued ahead
of it, else the one writer thread does: lines never interleave (one `write(2)` each
round, in call order); a crash leaves whole lines.
Sizes are capped and secrets redacted (see sandbox.guard.actionline).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, NamedTuple

from sandbox.contracts.guardparts import DEFAULT_DURABILITY, Durability
from sandbox.contracts.wire import ActionLine
from sandbox.guard.actionline import MAX_ITEMS as MAX_ITEMS
from sandbox.guard.actionline import MAX_LINE_BYTES as MAX_LINE_BYTES
from sandbox.guard.actionline import MAX_VALUE_CHARS as MAX_VALUE_CHARS
from sandbox.guard.actionline import REDACTED as REDACTED
from sandbox.guard.actionline import _model_line as _model_line
from sandbox.guard.actionline import _summarized as _summarized
from sandbox.guard.actionline import action_line
from sandbox.guard.actionline import encode_line as encode_line
from sandbox.guard.actionline import redact as redact
from sandbox.guard.logwriter import _GroupCommit, _Waiter
from sandbox.guard.logwriter import _Line as _Line
from sandbox.guard.logwriter import _Mailbox as _Mailbox

MAX_LOG_BYTES = 48 * 1024 * 1024  # calls stop being forwarded past this
OUTCOME_RESERVE_BYTES = 8 * 1024 * 1024  # outcomes and markers may use this much more
# Per-call only: an egress outcome line may wait this long for the next line's sync.
HOLD_S = 0.020
# Group commit: what is written is synced at most this long after (plus one sync's
# time). A line written is already safe from the guard's death; the sync only guards
# against the host losing its page cache, which also kills the run (its record stays
# `running`, then `killed`, and verifies nothing). 50 ms bounds what a host crash
# loses to a twentieth of a second of lines and the syncs to 20 a second per run
# however many calls arrive, where a sync per call round cost 40-60% of a call.
SYNC_INTERVAL_S = 0.050
LOG_TOOL = "action-log"


class LogFull(Exception):
    """The log reached its cap: the call must be stubbed, not forwarded unlogged."""


def _full_reason() -> str:
    return (
        f"the action log reached its cap of {MAX_LOG_BYTES // 2**20} MiB, "
        "so no further call is forwarded"
    )


class Started(NamedTuple):
    """A forwarded call whose `start` line is written (per-call with
    `begin(durable=True)`: synced too); its `outcome` line is still due. (Immutable as
    a tuple: one is made per forwarded call, and a frozen dataclass's fields are each
    set through `object.__setattr__`.)"""

    call_id: str
    session: str
    tool: str
    decision: str
    reason: str
    category: str
    started: float  # time.perf_counter() at the start line
    # What the `then` given to `begin` raised (it ran on the writer thread, right after
    # the line was written): the caller's to report as the call's outcome.
    then_error: BaseException | None = None


class _SettledOnException:
    """What `ActionLog.settled_on_exception` returns. It holds no state of its own, so
    one per log serves every call at once, and a forwarded call allocates nothing
    for it (a generator-based context manager costs a few microseconds a call)."""

    __slots__ = ("_log",)

    def __init__(self, log: ActionLog) -> None:
        self._log = log

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # any BaseException, CancelledError too; never swallowed. In group commit the
        # start line was written when `begin` returned: nothing of the call is pending.
        if kind is not None and self._log.per_call:
            await self._log.settle()


class ActionLog:
    """The run's action log. Every method that writes a line is a coroutine that
    returns once the line is written; per-call, once it is on disk, except
    `begin(durable=False)` (see actionlog.spec.md)."""

    def __init__(
        self,
        path: str,
        *,
        secrets: tuple[str, ...],
        durability: Durability = DEFAULT_DURABILITY,
        step: str = "",
    ) -> None:
        self._step = step
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        self._secrets = secrets
        self._bytes = os.fstat(self._fd).st_size
        self._next_call = 0
        self._full = False
        self._unlogged = 0  # calls answered without a line since the log filled
        self._closed = False
        self.per_call = durability == "per-call"
        self._writer = _GroupCommit(
            self._fd, per_call=self.per_call, hold_s=HOLD_S, sync_interval_s=SYNC_INTERVAL_S
        )
        self._settled_on_exception = _SettledOnException(self)

    @property
    def syncs(self) -> int:
        """How many times the log was synced so far (per-call: one per group of lines
        waited for; group commit: at most one per SYNC_INTERVAL_S)."""
        return self._writer.syncs

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

    async def write(
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
        line = action_line(
            self._step, self._secrets, "call", None, None, session, tool, decision, reason,
            category, arguments, duration_ms, detail,
        )  # fmt: skip
        if not self._room_for(len(line), reserve=False):
            self._unlogged += 1
            await self.settle()  # the marker that says so is on disk before the answer
            return
        await self._append(line)

    # -- forwarded calls -------------------------------------------------------------

    async def begin(
        self,
        *,
        session: str,
        tool: str,
        decision: str,
        reason: str,
        category: str,
        arguments: dict[str, Any],
        detail: dict[str, Any] | None = None,
        then: Callable[[], object] | None = None,
        durable: bool = True,
    ) -> Started:
        """The `start` line of a call about to be forwarded: in the file before it
        returns (per-call with `durable`: synced too).

        Per-call without `durable` (bridge, MCP: their reply waits for the `outcome`
        line's sync, which covers this line) the call costs one sync, not two; the
        caller must then answer only after `outcome`, or inside `settled_on_exception`
        on a path that answers without one. With it (egress: the reply is relayed as it
        comes, its outcome queued after) `begin` returns once the line is on disk. In
        group commit `durable` changes nothing: no call waits for the disk.

        `then` (the call's first effect, e.g. its head written to an upstream socket
        that is already open) runs the moment the line is written, before any sync, on
        the thread that wrote it (the loop in group commit when nothing was queued ahead,
        else the writer thread, before the loop is woken): the effect waits neither for
        the disk nor for a hop back to the loop. It must be quick and must not touch
        the loop; what it raises is in the result's `then_error`. It never runs
        when the write failed or the log is full. A failed write or sync raises that
        OSError; after a failed sync `then` may have run (the head went): the caller
        must fail the call, never relay its reply.

        Raises LogFull when the log has no room: the caller stubs the call."""
        self._next_call += 1
        call_id = f"c{self._next_call}"
        line = action_line(
            self._step, self._secrets, "start", call_id, None, session, tool, decision, reason,
            category, arguments, None, detail,
        )  # fmt: skip
        if not self._room_for(len(line), reserve=False):
            self._unlogged += 1
            await self.settle()  # the marker that says so is on disk before the stub
            raise LogFull(_full_reason())
        began = time.perf_counter()
        then_error = await self._append(line, then, durable=durable)
        return Started(call_id, session, tool, decision, reason, category, began, then_error)

    async def outcome(
        self, call: Started, *, ok: bool, reason: str = "", detail: dict[str, Any] | None = None
    ) -> None:
        """The `outcome` line of a started call: ok or error, its duration, its sizes;
        written (per-call: on disk, with every line before it) when it returns. With
        no room left for it, `settle` all the same."""
        line = self._outcome_line(call, ok=ok, reason=reason, detail=detail)
        if self._room_for(len(line), reserve=True):
            await self._append(line)
        else:
            await self.settle()

    def outcome_queued(
        self, call: Started, *, ok: bool, reason: str = "", detail: dict[str, Any] | None = None
    ) -> None:
        """The `outcome` line of a call whose reply has already gone out (egress), queued
        in order but not waited for: written in the writer's next round, before any
        line queued after it (on a kept-alive connection, the next request's `start`).
        Per-call it is held: the writer waits up to HOLD_S for the next line and writes
        and syncs both at once, so a request costs one sync, not two. A guard killed
        before it is written loses it: the record then shows that request as
        started, outcome unknown."""
        line = self._outcome_line(call, ok=ok, reason=reason, detail=detail)
        if not self._room_for(len(line), reserve=True):
            return
        try:
            if self._write_now(line):
                return
        except OSError:
            return  # nobody waits for this line; the failed log fails every later call
        self._queue(line, None, hold=True)

    def _outcome_line(
        self, call: Started, *, ok: bool, reason: str, detail: dict[str, Any] | None
    ) -> bytes:
        return action_line(
            self._step, self._secrets, "outcome", call.call_id, "ok" if ok else "error",
            call.session, call.tool, call.decision, reason or call.reason, call.category, {},
            (time.perf_counter() - call.started) * 1000, detail,
        )  # fmt: skip

    # -- the file --------------------------------------------------------------------

    def _room_for(self, size: int, *, reserve: bool) -> bool:
        """Whether a line of `size` bytes fits; the first refusal writes the marker."""
        if self._closed:
            return False
        limit = MAX_LOG_BYTES + (OUTCOME_RESERVE_BYTES if reserve else 0)
        if not self._full and self._bytes + size > MAX_LOG_BYTES:
            self._full = True
            marker = self._marker(f"the action log reached its cap of {MAX_LOG_BYTES} bytes")
            self._queue(marker, None)  # on disk with (before) the line that found it full
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

    def _queue(self, data: bytes, waiter: _Waiter | None, *, hold: bool = False) -> None:
        self._bytes += len(data)
        self._writer.put(data, waiter, hold=hold)

    def _write_now(self, data: bytes) -> bool:
        """Group commit: append the line on the loop when nothing is queued ahead of it
        (see `_GroupCommit.write_now`); False when it must be queued instead."""
        if not self._writer.write_now(data):
            return False
        self._bytes += len(data)
        return True

    async def _append(
        self, data: bytes, then: Callable[[], object] | None = None, *, durable: bool = True
    ) -> BaseException | None:
        """Append one line, in call order, and return once it is written and `then` ran
        (per-call with `durable`: once it is on disk); what `then` raised.

        In group commit the line is written here on the loop when it can be, and `then`
        runs right after it: no thread hop, no future, no wake-up of the loop."""
        if self._write_now(data):
            if then is None:
                return None
            try:
                then()
            except Exception as exc:  # the caller's to report, as its outcome
                return exc
            return None
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, loop.create_future(), then, durable=durable)
        self._queue(data, waiter)
        await waiter.future
        return waiter.then_error

    async def settle(self) -> None:
        """Return once every line queued so far is written (per-call: on disk, no sync
        when the last one covered them all). For a caller about to answer a call whose
        lines nobody waited for: a `log_full` marker, a started call answered without
        its outcome line. A cancellation does not cut the wait short for the lines (the
        writer writes them regardless), and a failed log is not raised here: the
        caller answers with its own failure (and the log's failure fails every later
        call)."""
        if self._closed or (not self.per_call and self._writer.idle()):
            return  # group commit: nothing queued is left unwritten
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, loop.create_future())
        self._writer.put(b"", waiter)
        with contextlib.suppress(OSError):
            await asyncio.shield(waiter.future)

    def settled_on_exception(self) -> _SettledOnException:
        """`async with` it around the forwarding of a started call (between
        `begin(durable=False)` and `outcome`): per-call, an exception that leaves the
        block, a cancellation too, goes on only once `settle` returned. The call is then
        answered without its outcome line, whose sync would have covered its start
        line (only written): no reply leaves before the lines of its call are on disk,
        even then. A normal exit costs nothing (the outcome's sync follows), and in
        group commit neither does an exception (the start line is written already)."""
        return self._settled_on_exception

    def close(self) -> None:
        """Write what is queued and sync it (the guard's orderly stop; the runner syncs
        once more when it seals the record); when the log filled up, say how many calls
        went unlogged since. Blocks until the writer's threads are done (the guard is
        stopping; nothing else waits on the loop)."""
        if self._closed:
            return
        try:
            if self._full and self._bytes < MAX_LOG_BYTES + OUTCOME_RESERVE_BYTES:
                marker = self._marker(
                    "the action log was full", {"stubbed_unlogged": self._unlogged}
                )
                self._queue(marker, None)
            self._writer.stop()
            if self._writer.error is None:  # a failed log has failed its calls already
                os.fsync(self._fd)
        finally:
            self._closed = True
            os.close(self._fd)
