"""The action log's contract: a line is written before its call goes on and before its
reply leaves (another process reads it then); lines are synced in group commit with no
call waiting for the disk, per-call before the call goes on when the host asks for it;
the runner's seal syncs the file."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sandbox.collect.actionsummary import read
from sandbox.collect.logseal import seal_log
from sandbox.contracts.wire import ActionLine
from sandbox.guard.actionlog import ActionLog
from tests.guard.actionlogparts import write_line
from tests.polling import wait_for

CALL = {"session": "root", "decision": "allow", "reason": "r", "category": "t", "arguments": {}}


def _read_elsewhere(path: Path) -> list[tuple[str, str]]:
    """(event, tool) of each line, as another process reads the file."""
    out = subprocess.run(["cat", str(path)], capture_output=True, check=True).stdout
    return [
        (line.event, line.tool)
        for line in (ActionLine.model_validate_json(raw) for raw in out.splitlines())
    ]


class _Disk:
    """`fdatasync` that counts, records how far each sync covered, and can be held
    (a disk that does not answer): a call that waited for it would not return."""

    def __init__(self) -> None:
        self._real = os.fdatasync
        self.covered: list[int] = []
        self.release = threading.Event()
        self.release.set()

    def __call__(self, fd: int) -> None:
        self.release.wait()
        size = os.fstat(fd).st_size
        self._real(fd)
        self.covered.append(size)


def test_a_start_line_is_in_the_file_before_the_call_reaches_its_upstream(tmp_path: Path) -> None:
    """Group commit: the upstream (a real socket server) reads the log from another
    process the moment the forwarded request reaches it, and finds the start line; the
    client finds the outcome line the moment its reply is in its hands."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    server = socket.create_server(("127.0.0.1", 0))
    seen_by_upstream: list[list[tuple[str, str]]] = []

    def upstream() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(100)
            seen_by_upstream.append(_read_elsewhere(path))
            conn.sendall(b"reply")

    thread = threading.Thread(target=upstream)
    thread.start()
    log = ActionLog(str(path), secrets=())

    async def call() -> list[tuple[str, str]]:
        started = await log.begin(tool="fwd", **CALL)  # type: ignore[arg-type]
        reader, writer = await asyncio.open_connection(*server.getsockname())
        writer.write(b"request")
        reply = await reader.read(100)
        writer.close()
        assert reply == b"reply"
        await log.outcome(started, ok=True)
        return _read_elsewhere(path)  # the client, its reply in hand

    try:
        at_reply = asyncio.run(call())
    finally:
        thread.join(timeout=30)
        server.close()
        log.close()
    assert seen_by_upstream == [[("start", "fwd")]]
    assert at_reply == [("start", "fwd"), ("outcome", "fwd")]


def test_group_commit_answers_without_waiting_for_the_disk_and_syncs_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the disk held, calls are still answered (nothing waits for a sync) and their
    lines are in the file; once the disk answers, a sync nobody asked for covers them."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    disk = _Disk()
    disk.release.clear()
    monkeypatch.setattr(os, "fdatasync", disk)
    log = ActionLog(str(path), secrets=())

    async def calls() -> None:
        started = await log.begin(tool="a", **CALL)  # type: ignore[arg-type]
        await write_line(log, "w", decision="allow", category="t")
        await log.outcome(started, ok=True)

    try:
        asyncio.run(calls())
        assert _read_elsewhere(path) == [("start", "a"), ("call", "w"), ("outcome", "a")]
        assert disk.covered == []
        disk.release.set()
        size = path.stat().st_size
        wait_for(lambda: size in disk.covered, 30, "a sync covering every line")
    finally:
        disk.release.set()
        log.close()
    assert log.syncs >= 1


def test_per_call_syncs_each_line_before_its_call_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`durability = "per-call"`: when a call's line returns, a sync covering it is done."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    disk = _Disk()
    monkeypatch.setattr(os, "fdatasync", disk)
    log = ActionLog(str(path), secrets=(), durability="per-call")
    sizes: list[int] = []

    async def calls() -> None:
        for n in range(3):
            await write_line(log, f"w{n}", decision="allow", category="t")
            sizes.append(path.stat().st_size)
            assert disk.covered and disk.covered[-1] == sizes[-1]
        started = await log.begin(tool="a", **CALL)  # type: ignore[arg-type]
        await log.outcome(started, ok=True)
        assert disk.covered[-1] == path.stat().st_size

    try:
        asyncio.run(calls())
    finally:
        log.close()
    assert log.syncs == len(disk.covered) >= 4


def test_a_guard_killed_mid_call_leaves_its_start_lines_and_every_answered_outcome(
    tmp_path: Path,
) -> None:
    """Group commit, SIGKILL: the answered call's outcome and the forwarded call's start
    (no outcome yet) are all in the file; the summary reads the second as started,
    outcome unknown."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    program = f"""
import asyncio, os, sys
from sandbox.guard.actionlog import ActionLog

log = ActionLog({str(path)!r}, secrets=())

async def main():
    call = dict(session="root", decision="allow", reason="r", category="t", arguments={{}})
    first = await log.begin(tool="a", **call)
    await log.write(tool="w", duration_ms=0.0, **call)
    await log.outcome(first, ok=True)
    sys.stdout.write("answered a\\n")
    await log.begin(tool="b", **call)
    sys.stdout.write("forwarded b\\n")
    sys.stdout.flush()
    os.kill(os.getpid(), 9)

asyncio.run(main())
"""
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout) == (-9, "answered a\nforwarded b\n"), done.stderr
    assert _read_elsewhere(path) == [
        ("start", "a"),
        ("call", "w"),
        ("outcome", "a"),
        ("start", "b"),
    ]
    summary = read(path)
    assert [c.tool for c in summary.outcome_unknown] == ["b"]


def test_the_seal_syncs_the_log_read_only_and_never_through_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    log = root / "test_mode_actions.jsonl"
    log.write_text('{"a": 1}\n')
    log.chmod(0o400)  # the runner needs no write access to sync it
    disk = _Disk()
    monkeypatch.setattr(os, "fdatasync", disk)
    at = seal_log(root, log.name)
    assert disk.covered == [log.stat().st_size] and at.tzinfo is not None

    (root / "link.jsonl").symlink_to(log)
    with pytest.raises(OSError):
        seal_log(root, "link.jsonl")
    os.mkfifo(root / "fifo.jsonl")
    with pytest.raises(OSError):
        seal_log(root, "fifo.jsonl")
    with pytest.raises(OSError):
        seal_log(root, "missing.jsonl")
    assert len(disk.covered) == 1
