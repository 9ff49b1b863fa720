"""The action log's writer: the one thread that appends lines, and the one that syncs them.

Lines reach the writer thread in the order the event loop queued them; it appends
every line queued since its last round with one `write(2)` on an O_APPEND
descriptor (lines never interleave; a crash leaves whole lines before a possibly
cut last one), runs each line's `then` and wakes its waiter. What a waiter waits
for depends on the log's durability (see actionlog.spec.md): per-call, the writer
syncs the round before it wakes the lines that wait for the disk; in group commit
nothing waits for the disk, and a separate thread syncs what was written at most
SYNC_INTERVAL_S after it, off the request path. In group commit the loop appends a
line itself (`write_now`) when nothing is queued ahead of it, no sync is under way
and its last append was not held by the kernel (`SLOW_WRITE_S`, `LOOP_PAUSE_S`), so
the common call has no hop to the writer thread and back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import math
import os
import select
import threading
import time
from collections.abc import Callable

# A line the loop appended itself whose write(2) took longer than this (a kernel that
# held it: beside another writer on the same disk, ext4's journal makes an append wait
# for its commit) sends the lines after it to the writer thread for LOOP_PAUSE_S, so
# the loop, which serves every call, does not meet the same wait again for each line
# meanwhile; only the calls whose lines wait do. Then the loop tries again. The time
# is the loop's (the write and the turn at the interpreter lock after it): 3 ms, the
# bridge's p99 goal, is past the lock's usual waits (its switch interval is 0.5 ms)
# and short of the holds that cost the goal (up to 65 ms beside the --load disk hog).
SLOW_WRITE_S = 0.003
LOOP_PAUSE_S = 0.100


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
    (`hold_s`, per-call only) for the next line's write and sync."""

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
        at most about 1 ms past its hold; None: no limit) has passed, and may then return
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


class _Syncer:
    """Group commit's sync thread: `fdatasync` of what the writer wrote, off the request
    path, at most one every SYNC_INTERVAL_S. A line written at t is synced by
    t + SYNC_INTERVAL_S + one sync's time. A failed sync is kept (`error`): the writer
    fails every later line with it (the log no longer says what it should)."""

    def __init__(self, fd: int, interval_s: float) -> None:
        self._fd = fd
        self._interval_s = interval_s
        self._dirty = threading.Event()  # written bytes no sync covers yet
        self._stopping = threading.Event()
        self.error: OSError | None = None
        self.syncs = 0
        # True from just before an fdatasync to just after: the loop leaves appends to the
        # writer thread meanwhile, since a write may wait on the inode the sync holds.
        self.syncing = False
        self._thread = threading.Thread(target=self._run, name="action-log-sync", daemon=True)
        self._thread.start()

    def written(self) -> None:
        """Bytes were appended: they are due for the next sync."""
        if not self._dirty.is_set():  # set() takes a lock and may wake the thread
            self._dirty.set()

    def _run(self) -> None:
        last = -math.inf
        while True:
            self._dirty.wait()
            if self._stopping.is_set():
                return  # close syncs what is left
            delay = last + self._interval_s - time.monotonic()
            if delay > 0 and self._stopping.wait(delay):
                return
            self._dirty.clear()  # what is written from here on is for the next sync
            last = time.monotonic()
            self.syncing = True
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                self.error = exc
                return
            finally:
                self.syncing = False
            self.syncs += 1

    def stop(self) -> None:
        """End the thread (blocks until it has); the caller syncs what is left."""
        self._stopping.set()
        self._dirty.set()
        self._thread.join()


class _GroupCommit:
    """The writer thread: appends queued lines in order, one `write(2)` per round for
    all the lines queued since the last one.

    Lines come through a `_Mailbox` (a put from the loop rings the writer only when it
    sleeps, without holding the interpreter lock while it rings). Once a round is
    written the writer runs each of its lines' `then` (before waking their loop: the
    effect follows its line without a hop back to the loop), then wakes the loops of
    the lines that waited only for the write.

    `per_call`: a round that holds only lines nobody waits for (`hold`: an egress
    outcome whose reply is already out) waits up to `hold_s`, from the oldest of them,
    for one more line and shares its write and sync; a line somebody waits for, the
    timer, or close ends the wait. The writer syncs when a line of the round needs it
    and something written is not yet synced, then wakes the lines that wait for the
    disk. Otherwise (group commit) no line waits for the disk and none is held: a
    `_Syncer` syncs behind the writer, and the loop may append a line itself
    (`write_now`) when the writer has nothing of its own left to write.

    After a failed write no `then` runs; after a failed write or sync every waiting
    line of the round, and each later one, fails."""

    def __init__(
        self, fd: int, *, per_call: bool, hold_s: float = 0.0, sync_interval_s: float = 0.05
    ) -> None:
        self._fd = fd
        self._per_call = per_call
        self._hold_s = hold_s
        self._syncer = None if per_call else _Syncer(fd, sync_interval_s)
        self._lines = _Mailbox()
        self._error: OSError | None = None
        self._stopped = False
        self._unsynced = False  # written bytes no sync covers yet (writer thread only)
        self._syncs = 0  # fdatasync calls made by the writer (per-call)
        # Lines handed to the writer (counted by the loop) and lines it has dealt with
        # (counted by the writer once a round is written and its `then`s ran): equal, the
        # writer holds nothing that must be in the file before a line the loop appends.
        # Each is written by one thread only, so no lock is needed to compare them.
        self._put = 0
        self._done = 0
        self._loop_paused_until = 0.0  # monotonic time: the loop writes nothing before it
        self._thread = threading.Thread(target=self._run, name="action-log", daemon=True)
        self._thread.start()

    @property
    def syncs(self) -> int:
        """fdatasync calls made so far: what the group commit saves is visible."""
        return self._syncs + (self._syncer.syncs if self._syncer is not None else 0)

    def put(self, data: bytes, waiter: _Waiter | None, *, hold: bool = False) -> None:
        if self._stopped:
            if waiter is not None:
                error = self._error or OSError(errno.EBADF, "the action log is closed")
                waiter.loop.call_soon(_settle, [waiter], error)
            return
        self._put += 1
        self._lines.put(_Line(data, waiter, hold=hold and self._per_call))

    def write_now(self, data: bytes) -> bool:
        """Group commit, on the loop: append `data` here and now when nothing queued is
        still to be written and no sync is under way (a write then waits for no thread
        and, on a page-cache append, for no disk); False otherwise (the caller queues
        it). A failed write fails the log (raised here; every later line fails too).

        RWF_NOWAIT would let the loop try even during a sync, but ext4 refuses it on a
        buffered write (EOPNOTSUPP on this project's hosts), so the sync is avoided; and
        a write that took longer than SLOW_WRITE_S all the same leaves the next
        LOOP_PAUSE_S of lines to the writer thread."""
        if (
            self._per_call
            or self._stopped
            or self._error is not None
            or self._put != self._done
            or self._syncer is None
            or self._syncer.syncing
            or self._syncer.error is not None
        ):
            return False
        began = time.monotonic()
        if began < self._loop_paused_until:
            return False
        try:
            written = os.write(self._fd, data)
            if written < len(data):  # a short write (a full disk): the rest, in order
                view = memoryview(data)[written:]
                while view:
                    view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._error = exc
            raise
        took = time.monotonic() - began
        if took > SLOW_WRITE_S:
            self._loop_paused_until = began + took + LOOP_PAUSE_S
        self._syncer.written()
        return True

    def idle(self) -> bool:
        """Whether every line handed to the writer is dealt with (a loop-side check)."""
        return self._put == self._done

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
                left = lines[0].queued + self._hold_s - time.monotonic()
                if left <= 0:
                    return lines, False
            lines += self._lines.take(left)  # none new in time: `left` is checked again

    def _write(self, batch: list[_Line]) -> None:
        data = memoryview(b"".join(line.data for line in batch))
        if data:
            self._unsynced = True
        while data:
            data = data[os.write(self._fd, data) :]
        if self._syncer is not None:
            self._syncer.written()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = self._round()
            if not batch:
                continue
            if self._error is None and self._syncer is not None:
                self._error = self._syncer.error  # a failed background sync fails the log
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
                woken = durable if waiter.durable and self._per_call else written
                woken.setdefault(waiter.loop, []).append(waiter)
            self._done += len(batch)  # the loop may append after these lines from now on
            _wake(written, error)
            must_sync = self._per_call and any(line.sync for line in batch)
            if error is None and must_sync and self._unsynced:
                try:
                    os.fdatasync(self._fd)
                    self._syncs += 1
                    self._unsynced = False
                except OSError as exc:
                    error = self._error = exc
            _wake(durable, error)

    @property
    def error(self) -> OSError | None:
        """The write or sync failure that failed the log, if any."""
        if self._error is None and self._syncer is not None:
            return self._syncer.error
        return self._error

    def stop(self) -> None:
        """Write what is queued, then end the threads (blocks until they have); the
        caller makes the final sync."""
        if not self._stopped:
            self._stopped = True
            self._lines.put(_STOP)
        self._thread.join()
        if self._syncer is not None:
            self._syncer.stop()
        self._lines.close()


def _wake(
    waiters: dict[asyncio.AbstractEventLoop, list[_Waiter]], error: BaseException | None
) -> None:
    """Settle each loop's waiters with one hand-off to it."""
    for loop, each in waiters.items():
        with contextlib.suppress(RuntimeError):  # a loop already closed: nobody waits
            loop.call_soon_threadsafe(_settle, each, error)
