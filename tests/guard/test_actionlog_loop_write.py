"""Group commit: the event loop appends a call's line itself when nothing is queued
ahead of it, and hands it to the writer thread otherwise, with the lines always in
the order the calls made them (sandbox/guard/logwriter.py, `write_now`)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from sandbox.contracts.wire import ActionLine
from sandbox.guard import actionlog, logwriter
from sandbox.guard.actionlog import ActionLog
from tests.guard.actionlogparts import EGRESS_CALL, write_line
from tests.polling import wait_for


class _Writes:
    """`os.write` as the log module calls it, noting which thread made each write; the
    writer thread's writes take `slow_s` longer (a busy writer)."""

    def __init__(self, slow_s: float = 0.0) -> None:
        self.threads: list[int] = []
        self.slow_s = slow_s
        self._real = os.write

    def __call__(self, fd: int, data: bytes | memoryview) -> int:
        self.threads.append(threading.get_ident())
        if self.slow_s and threading.current_thread() is not threading.main_thread():
            time.sleep(self.slow_s)
        return self._real(fd, data)


def _lines(path: Path) -> list[ActionLine]:
    return [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]


def test_an_idle_log_writes_the_line_and_runs_its_effect_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing queued ahead, `begin`'s line is written by the loop's own thread and
    its effect (an egress head sent upstream) runs right after, on that thread: no hop
    to the writer thread and back on a request's path. The effect still finds its line
    in the file, and an outcome written after the reply is on the loop too."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    writes = _Writes()
    monkeypatch.setattr(os, "write", writes)
    # one sync right after the first line, the next not within the test: no sync is
    # under way while the later lines are written
    monkeypatch.setattr(actionlog, "SYNC_INTERVAL_S", 600.0)
    log = ActionLog(str(path), secrets=())
    seen: list[tuple[int, bool]] = []

    def effect() -> None:
        seen.append((threading.get_ident(), b'"n":1' in path.read_bytes()))

    async def main() -> int:
        for n in range(1, 4):
            started = await log.begin(
                tool="http",
                arguments={"n": n},
                then=effect if n == 1 else None,
                **EGRESS_CALL,  # type: ignore[arg-type]
            )
            if n == 1:
                await asyncio.to_thread(wait_for, lambda: log.syncs == 1, 10.0, "the first sync")
            log.outcome_queued(started, ok=True)
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    log.close()
    assert seen == [(loop_thread, True)]
    assert writes.threads == [loop_thread] * 6
    assert [(ln.event, ln.call_id) for ln in _lines(path)] == [
        (event, f"c{n}") for n in range(1, 4) for event in ("start", "outcome")
    ]


def test_lines_behind_a_busy_writer_keep_the_order_of_their_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the writer thread still holds lines (its writes slow, a sync under way),
    a later call's line is never appended by the loop ahead of them: many calls at once,
    some lines by the writer and some by the loop, land in the order they were made."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    writes = _Writes(slow_s=0.01)
    monkeypatch.setattr(os, "write", writes)
    real_sync = os.fdatasync

    def slow_sync(fd: int) -> None:
        time.sleep(0.005)
        real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", slow_sync)
    monkeypatch.setattr(os, "fsync", slow_sync)
    log = ActionLog(str(path), secrets=())
    order: list[str] = []

    async def call(n: int) -> None:
        for step in range(3):
            await asyncio.sleep(0.0005 * ((n * 7 + step) % 5))
            order.append(f"t{n}.{step}")
            await write_line(log, f"t{n}.{step}")

    async def main() -> int:
        await asyncio.gather(*(call(n) for n in range(40)))
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    log.close()
    assert [ln.tool for ln in _lines(path)] == order
    # both ways were taken: the loop's own appends and the writer's rounds
    assert loop_thread in writes.threads
    assert any(t != loop_thread for t in writes.threads)


def test_a_queued_outcome_the_loop_cannot_write_fails_the_next_call_not_the_reply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An egress outcome is written after its reply went out, and nobody waits for it: a
    write that fails there raises nothing into the relay, and the log, failed, refuses
    the next call's start line (nothing is forwarded unlogged)."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    monkeypatch.setattr(actionlog, "SYNC_INTERVAL_S", 600.0)
    log = ActionLog(str(path), secrets=())
    real_write = os.write

    def full_disk(fd: int, data: bytes | memoryview) -> int:
        if b'"event":"outcome"' in bytes(data):
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    async def main() -> str:
        started = await log.begin(tool="http", arguments={"n": 1}, **EGRESS_CALL)  # type: ignore[arg-type]
        await asyncio.to_thread(wait_for, lambda: log.syncs == 1, 10.0, "the first sync")
        monkeypatch.setattr(os, "write", full_disk)
        log.outcome_queued(started, ok=True)
        monkeypatch.setattr(os, "write", real_write)
        try:
            await log.begin(tool="http", arguments={"n": 2}, **EGRESS_CALL)  # type: ignore[arg-type]
        except OSError as exc:
            return str(exc.strerror)
        return "forwarded"

    assert asyncio.run(main()) == "No space left on device"
    log.close()
    assert [(ln.event, ln.call_id) for ln in _lines(path)] == [("start", "c1")]


def test_a_line_the_kernel_takes_in_parts_is_written_whole_and_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write the kernel cut short (a disk nearly full) goes on from where it stopped:
    every line whole, in order, each written by the loop."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    real = os.write

    def short(fd: int, data: bytes | memoryview) -> int:
        return real(fd, bytes(data[:7]))

    monkeypatch.setattr(os, "write", short)
    monkeypatch.setattr(actionlog, "SYNC_INTERVAL_S", 600.0)
    log = ActionLog(str(path), secrets=())

    async def main() -> None:
        for n in range(1, 4):
            started = await log.begin(tool="http", arguments={"n": n}, **EGRESS_CALL)  # type: ignore[arg-type]
            log.outcome_queued(started, ok=True)

    asyncio.run(main())
    log.close()
    assert [(ln.event, ln.call_id, ln.arguments) for ln in _lines(path)] == [
        (event, f"c{n}", {"n": n} if event == "start" else {})
        for n in range(1, 4)
        for event in ("start", "outcome")
    ]


def test_a_loop_write_the_kernel_held_leaves_the_next_lines_to_the_writer_for_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line the loop appended itself whose write(2) took longer than SLOW_WRITE_S (the
    kernel held it: the journal busy beside another writer on the disk) sends the lines
    after it to the writer thread for LOOP_PAUSE_S, in order, each still written before
    its call goes on; then the loop writes its lines itself again."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    real_write = os.write
    written: list[tuple[int, bytes]] = []  # (thread, bytes) of every write, in order

    def write(fd: int, data: bytes | memoryview) -> int:
        data = bytes(data)
        written.append((threading.get_ident(), data))
        if b'"call_id":"c2","outcome":null' in data:  # c2's start line: held 50 ms
            time.sleep(0.05)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(actionlog, "SYNC_INTERVAL_S", 600.0)  # one sync, after the first line
    monkeypatch.setattr(logwriter, "LOOP_PAUSE_S", 1.0)
    log = ActionLog(str(path), secrets=())

    async def main() -> int:
        for n in range(1, 4):
            started = await log.begin(tool="http", arguments={"n": n}, **EGRESS_CALL)  # type: ignore[arg-type]
            if n == 1:
                await asyncio.to_thread(wait_for, lambda: log.syncs == 1, 10.0, "the first sync")
            log.outcome_queued(started, ok=True)
        paused_until = log._writer._loop_paused_until
        await asyncio.to_thread(
            wait_for,
            lambda: time.monotonic() > paused_until and log._writer.idle(),
            10.0,
            "the pause's end",
        )
        started = await log.begin(tool="http", arguments={"n": 4}, **EGRESS_CALL)  # type: ignore[arg-type]
        log.outcome_queued(started, ok=True)
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    log.close()

    def writer_of(call_id: str, event: str) -> str:
        mark = f'"event":"{event}","call_id":"{call_id}"'.encode()
        (thread,) = [t for t, data in written if mark in data]
        return "loop" if thread == loop_thread else "writer"

    assert [(ln.event, ln.call_id) for ln in _lines(path)] == [
        (event, f"c{n}") for n in range(1, 5) for event in ("start", "outcome")
    ]
    assert [writer_of(f"c{n}", e) for n in range(1, 5) for e in ("start", "outcome")] == [
        "loop", "loop",  # c1
        "loop", "writer",  # c2: its start line held 50 ms on the loop
        "writer", "writer",  # c3: within the pause
        "loop", "loop",  # c4: after it
    ]  # fmt: skip
