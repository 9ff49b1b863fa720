"""Each workflow's verification history: `runs/verifications.jsonl` (one step's) and
`runs/workflow_verifications.jsonl` (whole chains').

One line per verification, appended by the host with one `write(2)` on an
O_APPEND descriptor (never half a line beside another writer), opened without
following a link. The file lives beside the test runs (not a run folder, so `sandbox gc
--remove-runs` leaves it when it removes their folders). Lines
that do not parse are skipped and counted, never trusted.
"""

from __future__ import annotations

import os
import stat
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, ValidationError

from sandbox.contracts.record import ContentHash
from sandbox.verify.verdict import Verification

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


def history_path(workflow_dir: Path) -> Path:
    return workflow_dir / "runs" / HISTORY_FILE


def workflow_history_path(workflow_dir: Path) -> Path:
    return workflow_dir / "runs" / WORKFLOW_HISTORY_FILE


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
        ),
    )


def append_entry(workflow_dir: Path, entry: HistoryEntry) -> None:
    _append_line(history_path(workflow_dir), entry)


def append_workflow(workflow_dir: Path, entry: WorkflowHistoryEntry) -> None:
    _append_line(workflow_history_path(workflow_dir), entry)


def _append_line(path: Path, entry: BaseModel) -> None:
    data = (entry.model_dump_json() + "\n").encode()
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_lines(path: Path) -> list[bytes]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return []
        return handle.read(MAX_HISTORY_BYTES).splitlines()


def read_workflow(workflow_dir: Path) -> list[WorkflowHistoryEntry]:
    """The workflow verifications, oldest first."""
    out: list[WorkflowHistoryEntry] = []
    for raw in _read_lines(workflow_history_path(workflow_dir)):
        try:
            out.append(WorkflowHistoryEntry.model_validate_json(raw))
        except ValidationError:
            continue
    return out


def read(workflow_dir: Path, step_id: str | None = None) -> list[HistoryEntry]:
    """The history, oldest first (only `step_id`'s when given)."""
    out: list[HistoryEntry] = []
    for raw in _read_lines(history_path(workflow_dir)):
        try:
            entry = HistoryEntry.model_validate_json(raw)
        except ValidationError:
            continue
        if step_id is None or entry.step_id == step_id:
            out.append(entry)
    return out
