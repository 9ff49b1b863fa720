"""Each workflow's verification history: `runs/test-verifications/verifications.jsonl`
(one step's) and `runs/test-verifications/workflow_verifications.jsonl` (whole chains').

Under a `runs/test-*` name, so test mode writes nothing beside the real runs (Pulse
skips `runs/test-*`; the step's view of the workflow folder hides it like every test
run's folder), yet not a run: `layout.is_test_run` leaves it out, so `sandbox list`
shows no run for it and `sandbox gc --remove-runs` keeps it. The files an older
version wrote straight in `runs/` are ignored (their hashes follow an older definition
of the version, which no current hash matches).

One line per verification, appended by the host with one `write(2)` on an O_APPEND
descriptor (never half a line beside another writer); the folder and the file are
opened from `runs/` by fd, never through a link. Lines that do not parse are skipped,
never trusted.
"""

from __future__ import annotations

import contextlib
import os
import stat
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from sandbox.contracts.layout import HISTORY_DIR
from sandbox.contracts.record import ContentHash, Walls
from sandbox.hostfs import fdtree
from sandbox.verify.verification import Verification

HISTORY_FILE = "verifications.jsonl"
WORKFLOW_HISTORY_FILE = "workflow_verifications.jsonl"
MAX_HISTORY_BYTES = 32 * 1024 * 1024


class HistoryEntry(BaseModel):
    run_id: str
    step_id: str
    at: datetime
    passed: bool
    content: ContentHash | None = None
    expectations_digest: str
    failed: list[str] = []
    walls: Walls | None = None  # the run's; None: not recorded (the gate refuses)
    replayed_from: str | None = None  # the run whose recording answered its reads


class WorkflowHistoryEntry(BaseModel):
    """One workflow verification: which expectations file, which steps at which hash."""

    run_id: str
    at: datetime
    passed: bool
    expectations_file: str
    expectations_digest: str
    chain_steps: list[str]
    content: dict[str, ContentHash] = {}  # step id -> its content hash in that run
    failed: list[str] = []
    walls: dict[str, Walls] = Field(default_factory=dict)  # step id -> its run's walls


def history_path(workflow_dir: Path) -> Path:
    return workflow_dir / "runs" / HISTORY_DIR / HISTORY_FILE


def workflow_history_path(workflow_dir: Path) -> Path:
    return workflow_dir / "runs" / HISTORY_DIR / WORKFLOW_HISTORY_FILE


def append(workflow_dir: Path, verification: Verification) -> None:
    append_entry(
        workflow_dir,
        HistoryEntry(
            run_id=verification.run_id,
            step_id=verification.step_id,
            at=verification.at,
            passed=verification.passed,
            content=verification.content,
            expectations_digest=verification.expectations_digest,
            failed=[r.label for r in verification.results if not r.ok],
            walls=verification.walls,
            replayed_from=verification.replay.run_id if verification.replay else None,
        ),
    )


def append_entry(workflow_dir: Path, entry: HistoryEntry) -> None:
    _append_line(workflow_dir, HISTORY_FILE, entry)


def append_workflow(workflow_dir: Path, entry: WorkflowHistoryEntry) -> None:
    _append_line(workflow_dir, WORKFLOW_HISTORY_FILE, entry)


def _history_dir(workflow_dir: Path, *, create: bool) -> int:
    """`runs/test-verifications/` as an fd (made when `create`), no link followed."""
    if create:
        with contextlib.suppress(FileExistsError):  # a link there is refused just below
            os.mkdir(workflow_dir / "runs", 0o755)
    runs = fdtree.open_root(workflow_dir / "runs")
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(HISTORY_DIR, 0o755, dir_fd=runs)
        return os.open(HISTORY_DIR, fdtree.DIR_FLAGS, dir_fd=runs)
    finally:
        os.close(runs)


def _append_line(workflow_dir: Path, name: str, entry: BaseModel) -> None:
    data = (entry.model_dump_json() + "\n").encode()
    folder = _history_dir(workflow_dir, create=True)
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o644, dir_fd=folder)
    finally:
        os.close(folder)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{HISTORY_DIR}/{name} is not a regular file")
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_lines(workflow_dir: Path, name: str) -> list[bytes]:
    try:
        folder = _history_dir(workflow_dir, create=False)
    except OSError:
        return []
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder
        )
    except OSError:
        return []
    finally:
        os.close(folder)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return []
        return handle.read(MAX_HISTORY_BYTES).splitlines()


def read_workflow(workflow_dir: Path) -> list[WorkflowHistoryEntry]:
    """The workflow verifications, oldest first."""
    out: list[WorkflowHistoryEntry] = []
    for raw in _read_lines(workflow_dir, WORKFLOW_HISTORY_FILE):
        try:
            out.append(WorkflowHistoryEntry.model_validate_json(raw))
        except ValidationError:
            continue
    return out


def read(workflow_dir: Path, step_id: str | None = None) -> list[HistoryEntry]:
    """The history, oldest first (only `step_id`'s when given)."""
    out: list[HistoryEntry] = []
    for raw in _read_lines(workflow_dir, HISTORY_FILE):
        try:
            entry = HistoryEntry.model_validate_json(raw)
        except ValidationError:
            continue
        if step_id is None or entry.step_id == step_id:
            out.append(entry)
    return out
