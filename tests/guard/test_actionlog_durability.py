"""The action log's durability contract (sandbox/guard/actionlog.spec.md): a line is
written before its call is forwarded and before its reply leaves; lines are synced in
group commit off the request path (fewer syncs than calls, a held outcome synced by the
timer or at close); a failed write or sync fails the call and every later one; a guard
killed at any instant leaves whole lines. Disks that are slow or fail on purpose stand
in for the real one where the timing must be forced."""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox.collect.actionsummary import read
from sandbox.contracts.wire import ActionLine
from sandbox.guard import actionlog
from sandbox.guard.actionlog import (
    ActionLog,
    Started,
)
from tests.guard.actionlogparts import EGRESS_CALL, write_line
from tests.polling import wait_for


class _SlowDisk:
    """`fdatasync` as a slow shared disk does it: each takes a while. Records, per sync,
    the thread it ran on and how many bytes of the file it covered."""

    def __init__(self, fd_path: Path, seconds: float) -> None:
        self.path = fd_path
        self.seconds = seconds
        self.threads: set[int] = set()
        self.synced_bytes = 0
        self._real = os.fdatasync

    def __call__(self, fd: int) -> None:
        self.threads.add(threading.get_ident())
        size = os.fstat(fd).st_size
        threading.Event().wait(self.seconds)
        self._real(fd)
        self.synced_bytes = size


def _slow_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds: float
) -> tuple[Path, _SlowDisk, ActionLog]:
    """A syncing log in a real file whose every sync takes `seconds` more and is noted
    (`_SlowDisk`): the file, the disk, the log."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    disk = _SlowDisk(path, seconds)
    monkeypatch.setattr(os, "fdatasync", disk)
    return path, disk, ActionLog(str(path), secrets=(), durability="per-call")


def _synced_through(path: Path, disk: _SlowDisk, tool: str, *, last: bool) -> bool:
    """Whether the syncs made so far cover the first line of `tool` (with `last`, its
    last line) and every line before it."""
    lines = path.read_bytes().split(b"\n")
    mine = [i for i, ln in enumerate(lines) if f'"tool":"{tool}"'.encode() in ln]
    end = sum(len(ln) + 1 for ln in lines[: mine[-1 if last else 0] + 1])
    return disk.synced_bytes >= end


def test_concurrent_calls_are_logged_in_order_with_fewer_syncs_than_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit: N calls at once, each answered only once its own line is synced,
    in the order they were made, with far fewer than N syncs and none of them on the
    event loop's thread."""
    path, disk, log = _slow_log(tmp_path, monkeypatch, 0.02)
    calls = 40
    covered: list[bool] = []

    async def call(n: int) -> None:
        await write_line(log, f"t{n}")
        # answered: this call's line (and every earlier one) is within a finished sync
        covered.append(_synced_through(path, disk, f"t{n}", last=False))

    async def main() -> int:
        await asyncio.gather(*(call(n) for n in range(calls)))
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    log.close()
    tools = [ActionLine.model_validate_json(x).tool for x in path.read_text().splitlines()]
    assert tools == [f"t{n}" for n in range(calls)]
    assert covered == [True] * calls
    assert 1 <= log.syncs <= calls // 4
    assert loop_thread not in disk.threads


def test_a_guard_that_dies_right_after_a_reply_loses_none_of_its_lines(tmp_path: Path) -> None:
    """Nothing in memory: once a call is answered its lines are in the file, even when
    the process dies the next instant without closing the log."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    program = f"""
import asyncio, os, sys
from sandbox.guard.actionlog import ActionLog

log = ActionLog({str(path)!r}, secrets=(), durability="per-call")

async def main():
    call = dict(session="root", decision="allow", reason="r", category="t", arguments={{}})
    started = await log.begin(tool="a", **call)
    await asyncio.gather(*(log.write(tool=f"w{{n}}", duration_ms=0.0, **call) for n in range(5)))
    await log.outcome(started, ok=True)
    sys.stdout.write("answered\\n")
    sys.stdout.flush()
    os._exit(9)

asyncio.run(main())
"""
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout) == (9, "answered\n"), done.stderr
    lines = [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]
    assert [(ln.event, ln.tool) for ln in lines] == [
        ("start", "a"),
        *[("call", f"w{n}") for n in range(5)],
        ("outcome", "a"),
    ]


def test_a_failed_sync_fails_the_call_and_every_later_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "actions.jsonl"
    path.touch()

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    log = ActionLog(str(path), secrets=(), durability="per-call")
    call = {"session": "root", "decision": "allow", "reason": "r", "category": "t", "arguments": {}}

    async def main() -> list[str]:
        failures = []
        for tool in ("a", "b"):
            try:
                await log.begin(tool=tool, **call)  # type: ignore[arg-type]
            except OSError as exc:
                failures.append(f"{tool}: {exc.strerror}")
        return failures

    assert asyncio.run(main()) == ["a: Input/output error", "b: Input/output error"]
    log.close()


def test_a_queued_outcome_is_on_disk_before_the_next_line_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Egress: the outcome of a reply already sent is not waited for, but it precedes the
    next request's start line on disk, and is covered by that line's sync."""
    monkeypatch.setattr(actionlog, "HOLD_S", 600.0)  # held until the next line, however late
    path, disk, log = _slow_log(tmp_path, monkeypatch, 0.01)
    call = {"session": "egress", "decision": "allow", "reason": "r", "category": "egress"}

    async def main() -> bool:
        first = await log.begin(tool="http", arguments={"n": 1}, **call)  # type: ignore[arg-type]
        log.outcome_queued(first, ok=True)
        await log.begin(tool="http", arguments={"n": 2}, **call)  # type: ignore[arg-type]
        return disk.synced_bytes == path.stat().st_size

    assert asyncio.run(main())
    # held: the outcome shared the next start line's write and sync
    assert log.syncs == 2
    log.close()
    lines = [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]
    assert [(ln.event, ln.call_id) for ln in lines] == [
        ("start", "c1"),
        ("outcome", "c1"),
        ("start", "c2"),
    ]


class _TimedDisk(_SlowDisk):
    """A `_SlowDisk` that also notes when each sync began (time.monotonic())."""

    def __init__(self, fd_path: Path, seconds: float) -> None:
        super().__init__(fd_path, seconds)
        self.began: list[float] = []

    def __call__(self, fd: int) -> None:
        self.began.append(time.monotonic())
        super().__call__(fd)


def test_then_runs_on_the_writer_once_the_line_is_written_and_begin_waits_for_the_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`begin(then=...)`: the effect follows its line at once, on the writer thread
    (no hop back to the loop), once the line is in the file and before its sync (the
    upstream works while the disk syncs); `begin` returns only once the line is on disk.
    What the effect raises is handed back, with the line on disk all the same."""
    path, disk, log = _slow_log(tmp_path, monkeypatch, 0.01)
    seen: list[tuple[int, bool, bool]] = []

    def effect() -> None:
        written = b'"n":1' in path.read_bytes()
        seen.append((threading.get_ident(), written, disk.synced_bytes >= path.stat().st_size))

    def broken() -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    async def main() -> tuple[int, int, bool, Started, Started]:
        first = await log.begin(tool="http", arguments={"n": 1}, then=effect, **EGRESS_CALL)  # type: ignore[arg-type]
        ran_before_return = len(seen)
        synced_at_return = disk.synced_bytes == path.stat().st_size
        second = await log.begin(tool="http", arguments={"n": 2}, then=broken, **EGRESS_CALL)  # type: ignore[arg-type]
        return threading.get_ident(), ran_before_return, synced_at_return, first, second

    loop_thread, ran_before_return, synced_at_return, first, second = asyncio.run(main())
    log.close()
    assert ran_before_return == 1 and synced_at_return
    ((thread, written, synced),) = seen
    assert written and not synced
    assert thread != loop_thread and thread in disk.threads
    assert first.then_error is None
    assert isinstance(second.then_error, ConnectionResetError)
    assert log.syncs == 2
    lines = [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]
    assert [(ln.event, ln.call_id) for ln in lines] == [("start", "c1"), ("start", "c2")]


FORWARDED = {"session": "root", "decision": "allow", "reason": "r", "category": "t"}


def test_a_forwarded_call_not_durable_at_begin_costs_one_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bridge and MCP: `begin(durable=False)` returns once the start line is in the file,
    with no sync of its own; the outcome's one sync covers both lines when it returns."""
    path, disk, log = _slow_log(tmp_path, monkeypatch, 0.005)

    async def main() -> list[tuple[bool, int, bool]]:
        seen = []
        for n in range(3):
            started = await log.begin(tool=f"t{n}", arguments={}, durable=False, **FORWARDED)  # type: ignore[arg-type]
            seen.append((f'"tool":"t{n}"'.encode() in path.read_bytes(), log.syncs, False))
            await log.outcome(started, ok=True)
            seen[-1] = (*seen[-1][:2], disk.synced_bytes == path.stat().st_size)
        return seen

    seen = asyncio.run(main())
    # at each begin's return: its line written, only the earlier calls' syncs made;
    # at each outcome's return: everything written is synced
    assert seen == [(True, 0, True), (True, 1, True), (True, 2, True)]
    assert log.syncs == 3
    log.close()
    events = [ActionLine.model_validate_json(x).event for x in path.read_text().splitlines()]
    assert events == ["start", "outcome"] * 3


def test_a_round_that_only_writes_does_not_sync_and_settle_syncs_what_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start lines that were only written cost no sync; `settle` (a started call answered
    without its outcome) syncs them, and costs nothing more once they are synced."""
    path, disk, log = _slow_log(tmp_path, monkeypatch, 0.0)
    calls = 20

    async def main() -> tuple[int, int, int, int]:
        await asyncio.gather(
            *(
                log.begin(tool=f"t{n}", arguments={}, durable=False, **FORWARDED)  # type: ignore[arg-type]
                for n in range(calls)
            )
        )
        written, after_begins = path.stat().st_size, log.syncs
        await log.settle()
        after_settle = log.syncs
        await log.settle()
        return written, after_begins, after_settle, log.syncs

    written, after_begins, after_settle, again = asyncio.run(main())
    assert (after_begins, after_settle, again) == (0, 1, 1)
    assert disk.synced_bytes == written == path.stat().st_size
    log.close()
    tools = [ActionLine.model_validate_json(x).tool for x in path.read_text().splitlines()]
    assert tools == [f"t{n}" for n in range(calls)]


@pytest.mark.parametrize("leaves_by", ["an exception", "a cancellation", "its end"])
def test_a_forwarding_left_by_an_exception_has_its_start_line_synced_before_it_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leaves_by: str
) -> None:
    """`settled_on_exception` around a forwarding whose start line was only written: an
    exception or a cancellation that leaves it reaches the caller, unchanged, only once
    that line is synced (the call is answered without its outcome); leaving it at its
    end costs no sync (the outcome's sync follows)."""
    path, disk, log = _slow_log(tmp_path, monkeypatch, 0.01)
    inside = asyncio.Event()

    async def forward() -> None:
        await log.begin(tool="t", arguments={}, durable=False, **FORWARDED)  # type: ignore[arg-type]
        async with log.settled_on_exception():
            inside.set()
            if leaves_by == "an exception":
                raise ConnectionResetError(104, "Connection reset by peer")
            if leaves_by == "a cancellation":
                await asyncio.Event().wait()  # the "upstream", never answering

    async def main() -> tuple[str, int, bool]:
        task = asyncio.ensure_future(forward())
        await inside.wait()
        unsynced = log.syncs
        if leaves_by == "a cancellation":
            task.cancel()
        try:
            await task
            raised = "nothing"
        except ConnectionResetError as exc:
            raised = f"reset: {exc.strerror}"
        except asyncio.CancelledError:
            raised = "cancelled"
        assert unsynced == 0
        return raised, log.syncs, disk.synced_bytes == path.stat().st_size

    raised, syncs, synced = asyncio.run(main())
    expected = {
        "an exception": ("reset: Connection reset by peer", 1, True),
        "a cancellation": ("cancelled", 1, True),
        "its end": ("nothing", 0, False),
    }
    assert (raised, syncs, synced) == expected[leaves_by]
    log.close()
    events = [ActionLine.model_validate_json(x).event for x in path.read_text().splitlines()]
    assert events == ["start"]


def test_concurrent_forwarded_calls_are_logged_in_order_with_fewer_syncs_than_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N bridge-style calls at once (start written, then outcome waited for): every line
    in order, each outcome answered only once its call's two lines are synced, and
    fewer syncs than calls (one round's sync covers many calls' lines)."""
    path, disk, log = _slow_log(tmp_path, monkeypatch, 0.01)
    calls = 40
    covered: list[bool] = []

    async def call(n: int) -> None:
        started = await log.begin(tool=f"t{n}", arguments={}, durable=False, **FORWARDED)  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the "upstream": other calls' lines queue meanwhile
        await log.outcome(started, ok=True)  # answered: both its lines within a sync
        covered.append(_synced_through(path, disk, f"t{n}", last=True))

    async def main() -> None:
        await asyncio.gather(*(call(n) for n in range(calls)))

    asyncio.run(main())
    log.close()
    lines = [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]
    starts = [ln.tool for ln in lines if ln.event == "start"]
    assert starts == [f"t{n}" for n in range(calls)]
    where = {(ln.event, ln.call_id): i for i, ln in enumerate(lines)}
    assert all(where["start", f"c{n}"] < where["outcome", f"c{n}"] for n in range(1, calls + 1))
    assert covered == [True] * calls
    assert 1 <= log.syncs < calls


def test_an_outcome_past_the_reserve_still_syncs_its_start_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outcome that no longer fits is not written, but the call's start line (only
    written by `begin`) is synced before `outcome` returns: the reply still follows a
    sync that covers every line of its call."""
    path, disk, log = _slow_log(tmp_path, monkeypatch, 0.0)

    async def main() -> tuple[int, int]:
        started = await log.begin(tool="t", arguments={}, durable=False, **FORWARDED)  # type: ignore[arg-type]
        monkeypatch.setattr(actionlog, "MAX_LOG_BYTES", 0)
        monkeypatch.setattr(actionlog, "OUTCOME_RESERVE_BYTES", 0)
        before = log.syncs
        await log.outcome(started, ok=True)
        return before, log.syncs

    assert asyncio.run(main()) == (0, 1)
    assert disk.synced_bytes == path.stat().st_size
    log.close()
    events = [ActionLine.model_validate_json(x).event for x in path.read_text().splitlines()]
    assert events[:2] == ["start", "log_full"] and "outcome" not in events


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_then_never_runs_after_a_failed_write() -> None:
    """A log on a full device: the write fails with ENOSPC, `begin` raises it, and the
    effect does not happen, for that call or any later one."""
    log = ActionLog("/dev/full", secrets=(), durability="per-call")
    ran: list[int] = []

    async def main() -> list[int | None]:
        errors: list[int | None] = []
        for n in range(2):
            try:
                await log.begin(
                    tool="http",
                    arguments={"n": n},
                    then=lambda n=n: ran.append(n),  # type: ignore[misc]
                    **EGRESS_CALL,  # type: ignore[arg-type]
                )
            except OSError as exc:
                errors.append(exc.errno)
        return errors

    assert asyncio.run(main()) == [errno.ENOSPC, errno.ENOSPC]
    log.close()
    assert ran == []


def test_a_failed_sync_after_then_ran_fails_begin_and_no_later_then_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The effect ran (after the write, before the sync) and the sync fails: `begin`
    raises it, so the caller fails the call (its reply is never relayed); the next
    call's line is never written and its effect never runs."""
    path = tmp_path / "actions.jsonl"
    path.touch()

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    log = ActionLog(str(path), secrets=(), durability="per-call")
    ran: list[str] = []

    async def main() -> list[str]:
        errors = []
        for name in ("x", "y"):
            try:
                await log.begin(
                    tool="http",
                    arguments={},
                    then=functools.partial(ran.append, name),
                    **EGRESS_CALL,  # type: ignore[arg-type]
                )
            except OSError as exc:
                errors.append(str(exc.strerror))
        return errors

    assert asyncio.run(main()) == ["Input/output error", "Input/output error"]
    log.close()
    assert ran == ["x"]
    assert len(path.read_text().splitlines()) == 1


def test_a_held_outcome_alone_is_synced_by_the_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no next line, a held egress outcome is written once HOLD_S has passed, not
    before, in a sync of its own."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    disk = _TimedDisk(path, 0.0)
    monkeypatch.setattr(os, "fdatasync", disk)
    log = ActionLog(str(path), secrets=(), durability="per-call")

    async def main() -> float:
        started = await log.begin(tool="http", arguments={}, **EGRESS_CALL)  # type: ignore[arg-type]
        queued = time.monotonic()
        log.outcome_queued(started, ok=True)
        return queued

    queued = asyncio.run(main())
    wait_for(lambda: log.syncs == 2, 10, "the held outcome line to be synced")
    assert disk.began[-1] - queued >= actionlog.HOLD_S
    assert disk.synced_bytes == path.stat().st_size
    log.close()
    events = [ActionLine.model_validate_json(x).event for x in path.read_text().splitlines()]
    assert events == ["start", "outcome"]


def test_a_held_outcome_is_written_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actionlog, "HOLD_S", 600.0)  # only close can write it
    path = tmp_path / "actions.jsonl"
    path.touch()
    log = ActionLog(str(path), secrets=(), durability="per-call")

    async def main() -> None:
        started = await log.begin(tool="http", arguments={}, **EGRESS_CALL)  # type: ignore[arg-type]
        log.outcome_queued(started, ok=True)

    asyncio.run(main())
    t = time.monotonic()
    log.close()
    assert time.monotonic() - t < 60
    events = [ActionLine.model_validate_json(x).event for x in path.read_text().splitlines()]
    assert events == ["start", "outcome"]


def test_a_guard_killed_while_an_outcome_is_held_leaves_it_started_outcome_unknown(
    tmp_path: Path,
) -> None:
    """What a SIGKILL costs: only the held egress outcome (here held long, so the kill
    surely falls inside the hold). The record reads that request as started, outcome
    unknown; every line that was waited for is there."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    program = f"""
import asyncio, os, sys
from sandbox.guard import actionlog
from sandbox.guard.actionlog import ActionLog

actionlog.HOLD_S = 600.0
log = ActionLog({str(path)!r}, secrets=(), durability="per-call")

async def main():
    call = dict(session="egress", decision="allow", reason="r", category="egress", arguments={{}})
    first = await log.begin(tool="http", **call)
    log.outcome_queued(first, ok=True)
    second = await log.begin(tool="http", **call)  # flushes the first outcome
    log.outcome_queued(second, ok=True)  # held when the guard dies
    sys.stdout.write("answered\\n")
    sys.stdout.flush()
    os.kill(os.getpid(), 9)

asyncio.run(main())
"""
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout) == (-9, "answered\n"), done.stderr
    lines = [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]
    assert [(ln.event, ln.call_id) for ln in lines] == [
        ("start", "c1"),
        ("outcome", "c1"),
        ("start", "c2"),
    ]
    summary = read(path)
    assert summary.counts.allow == 2 and summary.counts.outcome_unknown == 1
    assert [c.call_id for c in summary.outcome_unknown] == ["c2"]


def _line(text: bytes) -> actionlog._Line:
    return actionlog._Line(text, None, hold=False)


def test_the_mailbox_rings_only_a_writer_that_sleeps() -> None:
    """A line put while the writer is busy costs no system call and is in its next
    take; a writer that found nothing sleeps until the next put rings it."""
    box = actionlog._Mailbox()
    try:
        box.put(_line(b"a"))
        box.put(_line(b"b"))
        assert not select.select([box._fd], [], [], 0)[0]  # nobody slept: nothing rung
        assert [x.data for x in box.take(None)] == [b"a", b"b"]
        assert box.take(0.01) == []  # nothing put: the wait ends at the timeout

        taken: list[list[bytes]] = []
        # A daemon, and rung at the end whatever happened: a lost wake-up fails the
        # test instead of leaving pytest waiting on the thread.
        writer = threading.Thread(
            target=lambda: taken.append([x.data for x in box.take(None)]), daemon=True
        )
        writer.start()
        wait_for(lambda: box._sleeping, 10, "the writer to sleep on the mailbox")
        box.put(_line(b"c"))
        writer.join(10)
        assert taken == [[b"c"]]
    finally:
        os.eventfd_write(box._fd, 1)
        box.close()


def test_a_leftover_ring_costs_one_empty_take_and_no_spin() -> None:
    """A put that rings a writer which had just stopped waiting leaves the ring behind:
    the next wait returns at once with nothing (the ring read and cleared), and the wait
    after it waits again for its whole timeout."""
    box = actionlog._Mailbox()
    try:
        box._sleeping = True  # as a writer that found nothing, about to wait
        box.put(_line(b"a"))  # rings; the writer then takes the line without waiting
        assert [x.data for x in box.take(None)] == [b"a"]
        started = time.monotonic()
        assert box.take(5) == []  # the leftover ring: back at once
        assert time.monotonic() - started < 2.5
        started = time.monotonic()
        assert box.take(0.05) == []
        assert time.monotonic() - started >= 0.04  # no ring left: it waited
    finally:
        box.close()
