"""`test_mode_actions.jsonl`: the guard's record of every guarded call, written by it alone.

Two shapes of entry. A call that is answered inside the guard (a stub, a
refusal, a session) is one line, `event="call"`. A call that is forwarded
(bridge upstream, MCP server, the step's executor, egress) gets a `start` line
before any byte of it leaves the guard (what was asked, the decision, a
`call_id`) and an `outcome` line after (ok or error, duration, sizes), so a
guard that dies mid-call leaves "started, outcome unknown" behind.

Durability without stalling (group commit): a line is written (in the file,
by `write(2)`) before the call it records goes on, and synced (`fdatasync`, by
default) before that call is answered; neither the write nor the sync runs on
the event loop's thread. One writer thread takes every line queued since its
last round (from a `_Mailbox`), in the order the calls queued them,
appends them with one `write(2)` on an O_APPEND descriptor (lines never
interleave; a crash leaves whole lines before a possibly cut last one) and, when
a line of the round is waited for on disk, syncs once for all of them. A sync
covers every line written before it, so a line that only had to be written is
made durable by the next sync: a bridge or MCP call's `begin` returns once its
`start` line is written (a guard killed after forwarding still leaves it: the
page cache outlives the process), and the call's `outcome` line's write and
sync, which the reply waits for, covers both. One sync per forwarded call, and
a round that only writes does not sync at all. A path that answers a started
call without its outcome (an error, a cancellation) waits for `settle` first
(its forwarding runs in `settled_on_exception`), and an outcome that no longer
fits waits for the sync all the same: no reply leaves before the lines of its
call are on disk.

An egress request's `begin` waits for the sync (its reply is relayed only once
the line is on disk), but what it asked to happen right after its line (`then`:
the request's head sent upstream) is run by the writer right after the round's
write, before its sync, with no hop back to the loop: the upstream works on the
request while the disk syncs. N calls that arrive while a sync is under way
cost one more sync, not N, and a slow disk stalls only the calls waiting for
their own lines, never the other connections of the run. Order, call ids and
size accounting are decided on the loop, when a line is queued. A failed write
fails that line's call and every later one, and no `then` runs after it; a
failed sync fails every call waiting in its round (an egress request whose head
already went is then answered with an error, its reply never relayed) and every
later one (the log no longer says what it should: fail closed).

One exception to "waited for": an egress outcome line (`outcome_queued`, the
reply already relayed) may wait up to HOLD_S (20 ms) for the next line and
share its write and sync, so a kept-alive connection costs one sync per
request. A guard killed (SIGKILL, power loss) within those 20 ms loses that
line: the record shows the request as started, outcome unknown. Bridge and MCP
outcome lines are waited for before their reply.
Only the guard's uid can write the file
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

import asyncio
import collections
import contextlib
import errno
import functools
import hashlib
import json
import math
import os
import re
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from pydantic_core import to_json

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
HOLD_S = 0.020  # an egress outcome line may wait this long for the next line's sync
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


@functools.lru_cache(maxsize=1024)
def _short_secret_key(key: str) -> bool:
    return _SECRET_KEY.search(key) is not None


def _secret_key(key: str) -> bool:
    """Whether an argument key names a credential. Keys repeat call after call, so a
    short key's answer is remembered (at most 1,024 keys of at most 64 characters: a
    hostile step cannot make the memo cost memory); a longer one is searched each time."""
    if len(key) <= 64:
        return _short_secret_key(key)
    return _SECRET_KEY.search(key) is not None


_SCALARS = (bool, int, float, type(None))
MAX_DEPTH = 20


def _redact_text(value: str, secrets: tuple[str, ...]) -> str:
    for secret in secrets:
        if secret and secret in value:
            value = value.replace(secret, REDACTED)
    if len(value) > MAX_VALUE_CHARS:
        cut = len(value) - MAX_VALUE_CHARS
        return value[:MAX_VALUE_CHARS] + f"[... {cut} chars cut; sha256 {_digest(value)}]"
    return value


def redact(value: Any, secrets: tuple[str, ...] = (), depth: int = 0) -> Any:
    """A copy of `value` safe and small enough to write down: credential keys and known
    secrets masked, long strings cut and hashed, long containers cut, nothing below
    MAX_DEPTH levels. (On every log line: a container's strings and numbers are
    handled in place, without a call each.)"""
    if depth > MAX_DEPTH:
        return "[too deep]"
    if isinstance(value, str):
        return _redact_text(value, secrets)
    if isinstance(value, _SCALARS):
        return value
    inner = depth + 1
    leaf_ok = inner <= MAX_DEPTH
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for n, (k, v) in enumerate(value.items()):
            if n == MAX_ITEMS:
                out["[cut]"] = f"{len(value) - MAX_ITEMS} more keys"
                break
            key = str(k)
            if _secret_key(key):
                out[key] = REDACTED
            elif leaf_ok and type(v) is str:
                out[key] = _redact_text(v, secrets)
            elif leaf_ok and type(v) in _SCALARS:
                out[key] = v
            else:
                out[key] = redact(v, secrets, inner)
        return out
    if isinstance(value, list | tuple):
        kept = [redact(v, secrets, inner) for v in value[:MAX_ITEMS]]
        if len(value) > MAX_ITEMS:
            kept.append(f"[... {len(value) - MAX_ITEMS} more items cut]")
        return kept
    return redact(str(value), secrets, inner)


def _summarized(value: dict[str, Any]) -> dict[str, Any]:
    """What stands in for arguments or detail too large for one line."""
    text = json.dumps(value, sort_keys=True, default=str)
    return {"[cut]": f"{len(text)} bytes as JSON; sha256 {_digest(text)}"}


@dataclass(frozen=True)
class Started:
    """A forwarded call whose `start` line is written (and with `begin(durable=True)`
    synced); its `outcome` line is still due."""

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


class _Waiter:
    """A caller waiting for its line: its loop and future, whether it waits for the
    sync or only the write (`durable`), and what it asked the writer to run once the
    line is written (`then`, and what that raised)."""

    __slots__ = ("durable", "future", "loop", "then", "then_error")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[None],
        then: Callable[[], object] | None = None,
        *,
        durable: bool = True,
    ) -> None:
        self.loop = loop
        self.future = future
        self.then = then
        self.durable = durable
        self.then_error: BaseException | None = None


def _settle(waiters: list[_Waiter], error: BaseException | None) -> None:
    for waiter in waiters:
        if waiter.future.done():
            continue  # its caller was cancelled; the line is written all the same
        if error is None:
            waiter.future.set_result(None)
        else:
            waiter.future.set_exception(error)


class _Line:
    """One queued line: its bytes, who waits for it (None: nobody), whether its round
    must sync (`sync`: a waiter that waits for the disk, a line nobody waits for, a
    held one; not a waiter that waits only for the write) and whether it may be held
    (HOLD_S) for the next line's write and sync."""

    __slots__ = ("data", "hold", "queued", "sync", "waiter")

    def __init__(self, data: bytes, waiter: _Waiter | None, *, hold: bool) -> None:
        self.data = data
        self.waiter = waiter
        self.hold = hold
        self.sync = waiter is None or waiter.durable
        self.queued = time.monotonic() if hold else 0.0


_STOP = _Line(b"", None, hold=False)  # close: write what is queued, then end


class _Mailbox:
    """The lines on their way from the loop to the writer thread: a deque, and an
    eventfd rung only when the writer sleeps on it.

    A `queue.SimpleQueue` wakes its getter with the interpreter lock held, so the
    woken writer (often on the loop's own CPU, preempting it) finds the lock taken,
    sleeps on it, and the loop must wake it a second time when it goes idle. The ring
    here is `os.eventfd_write`, which lets go of the lock for its system call: the
    woken writer takes it and writes at once. A line put while the writer is busy
    (writing, syncing) rings nothing: it is in the writer's next round."""

    def __init__(self) -> None:
        self._items: collections.deque[_Line] = collections.deque()
        self._fd = os.eventfd(0, os.EFD_CLOEXEC)  # blocking: a wait is one read
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)
        self._sleeping = False  # the writer found no line and waits for a ring

    def put(self, line: _Line) -> None:
        self._items.append(line)
        if self._sleeping:  # one ring per sleep is enough
            self._sleeping = False
            os.eventfd_write(self._fd, 1)

    def take(self, timeout: float | None) -> list[_Line]:
        """Every line put so far, in order. With none, waits until one is put or
        `timeout` (seconds, rounded up to whole milliseconds by poll: a held line waits
        at most about 1 ms past HOLD_S; None: no limit) has passed, and may then return
        none."""
        if not self._items:
            self._sleeping = True
            # A put from here on rings. A ring left by a put that came just before
            # this check only makes the next wait return at once, with no line.
            if not self._items and (
                timeout is None or self._poller.poll(math.ceil(timeout * 1000))
            ):
                os.eventfd_read(self._fd)  # without a timeout: blocks until rung
            self._sleeping = False
        taken = []
        while self._items:
            taken.append(self._items.popleft())
        return taken

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _GroupCommit:
    """The writer thread: appends queued lines in order, one `write(2)` per round for
    all the lines queued since the last one, and one `fdatasync` when a line of the
    round needs it.

    Lines come through a `_Mailbox` (a put from the loop rings the writer only when it
    sleeps, without holding the interpreter lock while it rings). A round that
    holds only lines nobody waits for (`hold`: an egress outcome whose reply is
    already out) waits up to HOLD_S, from the oldest of them, for one more line and
    shares its write and sync; a line somebody waits for, the timer, or close ends
    the wait. Once a round is written the writer runs each of its lines' `then`
    (before waking their loop: the effect follows its line without a hop back to
    the loop, and overlaps the sync), wakes the loops of the lines that waited only
    for the write, syncs when a line needs it and something written is not yet
    synced, then wakes the rest. After a failed write no `then` runs; after a failed
    write or sync every waiting line of the round, and each later one, fails."""

    def __init__(self, fd: int, *, sync: bool) -> None:
        self._fd = fd
        self._sync = sync
        self._lines = _Mailbox()
        self._error: OSError | None = None
        self._stopped = False
        self._unsynced = False  # written bytes no sync covers yet (writer thread only)
        self.syncs = 0  # fdatasync calls made: what the group commit saves is visible
        self._thread = threading.Thread(target=self._run, name="action-log", daemon=True)
        self._thread.start()

    def put(self, data: bytes, waiter: _Waiter | None, *, hold: bool = False) -> None:
        if self._stopped:
            if waiter is not None:
                error = self._error or OSError(errno.EBADF, "the action log is closed")
                waiter.loop.call_soon(_settle, [waiter], error)
            return
        self._lines.put(_Line(data, waiter, hold=hold))

    def _round(self) -> tuple[list[_Line], bool]:
        """The next round's lines (blocking until there is one), and whether close
        was asked for."""
        lines = self._lines.take(None)
        while True:
            if lines and lines[-1] is _STOP:
                return lines[:-1], True
            left: float | None = None  # no line yet: wait for one
            if lines:
                if not all(line.hold for line in lines) or self._error is not None:
                    return lines, False
                left = lines[0].queued + HOLD_S - time.monotonic()
                if left <= 0:
                    return lines, False
            lines += self._lines.take(left)  # none new in time: `left` is checked again

    def _write(self, batch: list[_Line]) -> None:
        data = memoryview(b"".join(line.data for line in batch))
        if data:
            self._unsynced = True
        while data:
            data = data[os.write(self._fd, data) :]

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = self._round()
            if not batch:
                continue
            error = self._error
            if error is None:
                try:
                    self._write(batch)
                except OSError as exc:
                    error = self._error = exc
            written: dict[asyncio.AbstractEventLoop, list[_Waiter]] = {}
            durable: dict[asyncio.AbstractEventLoop, list[_Waiter]] = {}
            for line in batch:
                waiter = line.waiter
                if waiter is None:
                    continue
                # a caller cancelled meanwhile (the guard stopping) gets no effect
                if error is None and waiter.then is not None and not waiter.future.cancelled():
                    try:
                        waiter.then()
                    except Exception as exc:  # the caller's to report, as its outcome
                        waiter.then_error = exc
                woken = durable if waiter.durable else written
                woken.setdefault(waiter.loop, []).append(waiter)
            _wake(written, error)
            must_sync = any(line.sync for line in batch)
            if error is None and must_sync and self._sync and self._unsynced:
                try:
                    os.fdatasync(self._fd)
                    self.syncs += 1
                    self._unsynced = False
                except OSError as exc:
                    error = self._error = exc
            _wake(durable, error)

    @property
    def error(self) -> OSError | None:
        """The write or sync failure that failed the log, if any."""
        return self._error

    def stop(self) -> None:
        """Write what is queued, then end the thread (blocks until it has)."""
        if not self._stopped:
            self._stopped = True
            self._lines.put(_STOP)
        self._thread.join()
        self._lines.close()


def _wake(
    waiters: dict[asyncio.AbstractEventLoop, list[_Waiter]], error: BaseException | None
) -> None:
    """Settle each loop's waiters with one hand-off to it."""
    for loop, each in waiters.items():
        with contextlib.suppress(RuntimeError):  # a loop already closed: nobody waits
            loop.call_soon_threadsafe(_settle, each, error)


# ActionLine's fields, in its order; the values `encode_line` checks as the model would.
_FIELDS = (
    "session",
    "tool",
    "decision",
    "reason",
    "category",
    "arguments",
    "duration_ms",
    "detail",
    "event",
    "call_id",
    "outcome",
)
_DECISIONS = frozenset({"allow", "stub", "redirect", "refuse"})
_EVENTS = frozenset({"call", "start", "outcome", "log_full"})
_OUTCOMES = frozenset({None, "ok", "error"})
_TEXT = ("session", "tool", "reason", "category")


def encode_line(now: datetime, step: str, fields: dict[str, Any]) -> bytes:
    """One `ActionLine` as its JSON line (newline included), without a model per line.

    Every line of every call goes through here, so the model's checks are made by
    hand (the literals, the call id's length, the types) and the plain dict of the
    already redacted values goes to the model's own serializer (pydantic-core's
    `to_json`, NaN and infinity as null as the model writes them): the same bytes
    as `ActionLine(...).model_dump_json()`, in half its time (building the model
    was most of it). A line the checks refuse goes through the model, which raises
    what it would have raised (tests/test_actionlog.py checks every kind of line
    against the model)."""
    event = fields.get("event", "call")
    call_id = fields.get("call_id")
    outcome = fields.get("outcome")
    duration = fields.get("duration_ms")
    if (
        fields["decision"] not in _DECISIONS
        or event not in _EVENTS
        or outcome not in _OUTCOMES
        or not (call_id is None or (type(call_id) is str and len(call_id) <= 40))
        or not all(type(fields[key]) is str for key in _TEXT if key in fields)
        or type(fields.get("arguments", {})) is not dict
        or type(fields.get("detail", {})) is not dict
        or not (duration is None or type(duration) is float)
        or type(step) is not str
    ):
        return _model_line(now, step, fields)  # the model says what is wrong
    line = {
        "time": now,
        "step": step,
        "session": fields["session"],
        "tool": fields["tool"],
        "decision": fields["decision"],
        "reason": fields["reason"],
        "category": fields.get("category", ""),
        "arguments": fields.get("arguments", {}),
        "duration_ms": duration,
        "detail": fields.get("detail", {}),
        "event": event,
        "call_id": call_id,
        "outcome": outcome,
    }
    return to_json(line, inf_nan_mode="null") + b"\n"


def _model_line(now: datetime, step: str, fields: dict[str, Any]) -> bytes:
    """The line through the model itself (raises what the model raises)."""
    line = ActionLine(time=now, step=step, **{k: fields[k] for k in _FIELDS if k in fields})
    return (line.model_dump_json() + "\n").encode()


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
        if kind is not None:  # any BaseException, CancelledError too; never swallowed
            await self._log.settle()


class ActionLog:
    """The run's action log. Every method that writes a line is a coroutine that
    returns once the line is on disk, except `begin(durable=False)`, which returns once
    it is written (see the module's docstring)."""

    def __init__(
        self, path: str, *, secrets: tuple[str, ...], fsync_each: bool = True, step: str = ""
    ) -> None:
        self._step = step
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        self._secrets = secrets
        self._bytes = os.fstat(self._fd).st_size
        self._next_call = 0
        self._full = False
        self._unlogged = 0  # calls answered without a line since the log filled
        self._closed = False
        self._writer = _GroupCommit(self._fd, sync=fsync_each)
        self._settled_on_exception = _SettledOnException(self)

    @property
    def syncs(self) -> int:
        """How many times the log was synced so far (one per group of lines)."""
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
        returns, and with `durable` synced too.

        Without `durable` (bridge, MCP: their reply waits for the `outcome` line's
        sync, which covers this line) the call costs one sync, not two; the caller
        must then answer only after `outcome`, or after `settle` on a path that
        answers without one. With it (egress: the reply is relayed as it comes, its
        outcome queued after) `begin` returns once the line is on disk.

        `then` (the call's first effect, e.g. its head written to an upstream socket
        that is already open) is run by the writer thread the moment the line is
        written, before its sync and before the loop is woken: the effect does not
        wait for the disk nor for a hop back to the loop. It must be quick and must not
        touch the loop; what it raises is in the result's `then_error`. It never runs
        when the write failed or the log is full. A failed write or sync raises that
        OSError; after a failed sync `then` may have run (the head went): the caller
        must fail the call, never relay its reply.

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
            await self.settle()  # the marker that says so is on disk before the stub
            raise LogFull(_full_reason())
        began = time.perf_counter()
        waiter = await self._append(line, then, durable=durable)
        return Started(call_id, session, tool, decision, reason, category, began, waiter.then_error)

    async def outcome(
        self, call: Started, *, ok: bool, reason: str = "", detail: dict[str, Any] | None = None
    ) -> None:
        """The `outcome` line of a started call: ok or error, its duration, its sizes;
        on disk, with every line before it (the call's `start` line too), when it
        returns. With no room left for it, the lines before it are synced all the same."""
        line = self._outcome_line(call, ok=ok, reason=reason, detail=detail)
        if self._room_for(len(line), reserve=True):
            await self._append(line)
        else:
            await self.settle()

    def outcome_queued(
        self, call: Started, *, ok: bool, reason: str = "", detail: dict[str, Any] | None = None
    ) -> None:
        """The `outcome` line of a call whose reply has already gone out (egress), queued
        in order but not waited for, and held: the writer waits up to HOLD_S for the
        next line (on a kept-alive connection, the next request's `start` line) and
        writes and syncs both at once, so a request costs one sync, not two. It is on
        disk no later than any line queued after it, at most HOLD_S after it was
        queued, and at close. A guard killed within those HOLD_S loses it: the
        record then shows that request as started, outcome unknown."""
        line = self._outcome_line(call, ok=ok, reason=reason, detail=detail)
        if self._room_for(len(line), reserve=True):
            self._queue(line, None, hold=True)

    def _outcome_line(
        self, call: Started, *, ok: bool, reason: str, detail: dict[str, Any] | None
    ) -> bytes:
        return self._line(
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

    # -- the file --------------------------------------------------------------------

    def _line(self, **fields: Any) -> bytes:
        fields["arguments"] = redact(fields["arguments"], self._secrets)
        fields["detail"] = redact(fields["detail"] or {}, self._secrets)
        fields["tool"] = str(fields["tool"])[:200]
        fields["reason"] = redact(str(fields["reason"]), self._secrets)
        if fields["duration_ms"] is not None:
            fields["duration_ms"] = round(fields["duration_ms"], 3)
        now = datetime.now(UTC)
        data = encode_line(now, self._step, fields)
        if len(data) > MAX_LINE_BYTES:
            fields["arguments"] = _summarized(fields["arguments"])
            fields["detail"] = _summarized(fields["detail"])
            data = encode_line(now, self._step, fields)
        return data

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

    async def _append(
        self, data: bytes, then: Callable[[], object] | None = None, *, durable: bool = True
    ) -> _Waiter:
        """Queue one line, in call order, and return once it is written and `then` ran
        (and with `durable`, once it is on disk)."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, loop.create_future(), then, durable=durable)
        self._queue(data, waiter)
        await waiter.future
        return waiter

    async def settle(self) -> None:
        """Return once every line queued so far is on disk (no sync when the last one
        covered them all). For a caller about to answer a started call without its
        outcome line (an exception or a cancellation between `begin` and `outcome`),
        whose start line `begin(durable=False)` only wrote. A cancellation does not cut
        the wait short for the lines (the writer syncs them regardless), and a failed
        log is not raised here: the caller answers with its own failure (and the log's
        failure fails every later call)."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, loop.create_future())
        self._writer.put(b"", waiter)
        with contextlib.suppress(OSError):
            await asyncio.shield(waiter.future)

    def settled_on_exception(self) -> _SettledOnException:
        """`async with` it around the forwarding of a started call (between
        `begin(durable=False)` and `outcome`): an exception that leaves the block, a
        cancellation too, goes on only once `settle` returned. The call is then
        answered without its outcome line, whose sync would have covered its start
        line (only written): no reply leaves before the lines of its call are on disk,
        even then. A normal exit costs nothing (the outcome's sync follows)."""
        return self._settled_on_exception

    def close(self) -> None:
        """Write what is queued and sync it; when the log filled up, say how many calls
        went unlogged since. Blocks until the writer thread is done (the guard is
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
