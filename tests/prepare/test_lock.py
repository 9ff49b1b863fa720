"""workflow_run_lock: flock exclusivity per workflow, holder reporting, release on death."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.contracts.errors import RefusedError
from sandbox.prepare.lock import (
    INFO_DIR_NAME,
    LOCK_FILE_NAME,
    LockError,
    LockHeldError,
    WorkflowLock,
    holders,
    lock_home,
    workflow_run_lock,
)

HOLDER = """
import sys, time
from pathlib import Path
from sandbox.prepare.lock import workflow_run_lock
lock = workflow_run_lock(Path(sys.argv[1]), exclusive=sys.argv[2] == "ex", owner=sys.argv[4])
ready = Path(sys.argv[3])
ready.with_suffix(".tmp").write_text("ready")
ready.with_suffix(".tmp").rename(ready)
while True:
    time.sleep(3600)
"""


def _wait_for(path: Path, proc: subprocess.Popen[bytes], deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"holder exited early with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError("holder did not become ready in time")
        time.sleep(0.01)


@pytest.fixture
def wf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SANDBOX_LOCK_DIR", str(tmp_path / "locks"))
    d = tmp_path / "workflow"
    d.mkdir()
    return d


def test_lock_leaves_the_workflow_folder_untouched(wf: Path) -> None:
    with workflow_run_lock(wf, exclusive=True, owner="t"):
        assert list(wf.iterdir()) == []
        assert (lock_home(wf) / LOCK_FILE_NAME).is_file()
    assert list(wf.iterdir()) == []


@pytest.fixture
def holder_proc(wf: Path, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(wf), "ex", str(ready), "holder-marker-xyz"]
    )
    try:
        _wait_for(ready, proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_exclusive_blocks_exclusive_and_shared(wf: Path) -> None:
    with workflow_run_lock(wf, exclusive=True, owner="test run t1") as lk:
        assert lk.held and lk.exclusive
        with pytest.raises(LockHeldError) as err:
            workflow_run_lock(wf, exclusive=True)
        with pytest.raises(LockHeldError):
            workflow_run_lock(wf, exclusive=False, owner="controller run 17")
        assert isinstance(err.value, RefusedError) and err.value.exit_code == 3
        msg = str(err.value)
        assert f"pid {os.getpid()}" in msg and "'test run t1'" in msg and "exclusive" in msg
        [h] = err.value.holders
        assert h.pid == os.getpid() and h.exclusive and h.owner == "test run t1"
        assert h.since is not None and h.locked_at is not None
    assert not lk.held
    with workflow_run_lock(wf, exclusive=True):
        pass


def test_shared_allows_shared_but_blocks_exclusive(wf: Path) -> None:
    a = workflow_run_lock(wf, owner="controller run 1")
    b = workflow_run_lock(wf, owner="controller run 2")
    try:
        hs = holders(wf)
        assert sorted(h.owner or "" for h in hs) == ["controller run 1", "controller run 2"]
        assert all(h.pid == os.getpid() and not h.exclusive for h in hs)
        with pytest.raises(LockHeldError) as err:
            workflow_run_lock(wf, exclusive=True, owner="test run")
        assert "controller run 1" in str(err.value) and "controller run 2" in str(err.value)
        a.release()
        with pytest.raises(LockHeldError):
            workflow_run_lock(wf, exclusive=True)
    finally:
        a.release()
        b.release()
    with workflow_run_lock(wf, exclusive=True):
        pass
    assert holders(wf) == []


def test_release_is_idempotent_and_removes_sidecar(wf: Path) -> None:
    lk = workflow_run_lock(wf, exclusive=True, owner="x")
    info = lock_home(wf) / INFO_DIR_NAME
    [sidecar] = list(info.iterdir())
    assert sidecar.name.startswith(f"{os.getpid()}-")
    data = json.loads(sidecar.read_text())
    assert data["owner"] == "x" and data["exclusive"] is True
    lk.release()
    lk.release()
    assert list(info.iterdir()) == []
    assert isinstance(lk, WorkflowLock) and not lk.held


def test_error_names_other_process_and_lock_dies_with_it(
    wf: Path, holder_proc: subprocess.Popen[bytes]
) -> None:
    with pytest.raises(LockHeldError) as err:
        workflow_run_lock(wf, exclusive=False, owner="controller run 17")
    msg = str(err.value)
    assert f"pid {holder_proc.pid}" in msg
    assert "holder-marker-xyz" in msg  # owner label from the sidecar, and in the command line
    [h] = err.value.holders
    assert h.pid == holder_proc.pid and h.exclusive
    assert "holder-marker-xyz" in h.command and sys.executable in h.command
    assert h.owner == "holder-marker-xyz" and h.since is not None

    holder_proc.send_signal(signal.SIGKILL)
    holder_proc.wait(timeout=30)
    # The kernel dropped the flock with the process; its sidecar is stale and ignored.
    assert holders(wf) == []
    assert any((lock_home(wf) / INFO_DIR_NAME).iterdir())
    with workflow_run_lock(wf, exclusive=True, owner="after kill"):
        names = [p.name for p in (lock_home(wf) / INFO_DIR_NAME).iterdir()]
        assert all(not n.startswith(f"{holder_proc.pid}-") for n in names)  # stale one removed


def test_other_workflow_is_independent(wf: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    with (
        workflow_run_lock(wf, exclusive=True, owner="a"),
        workflow_run_lock(other, exclusive=True, owner="b"),
    ):
        assert [h.owner for h in holders(wf)] == ["a"]
        assert [h.owner for h in holders(other)] == ["b"]


def test_symlinked_lock_file_is_refused(wf: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.lock"
    target.write_text("")
    (lock_home(wf) / LOCK_FILE_NAME).symlink_to(target)
    with pytest.raises(LockError, match="symlink"):
        workflow_run_lock(wf, exclusive=True)
    assert holders(wf) == []
    assert target.read_text() == ""


def test_symlinked_sidecar_dir_is_refused(wf: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (lock_home(wf) / INFO_DIR_NAME).symlink_to(target)
    with pytest.raises(LockError, match="symlink"):
        workflow_run_lock(wf, exclusive=True)
    assert list(target.iterdir()) == []
    # The failed attempt did not keep the lock.
    os.unlink(lock_home(wf) / INFO_DIR_NAME)
    with workflow_run_lock(wf, exclusive=True):
        pass
