"""Each workflow's verification history: `runs/verifications.jsonl`.

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
MAX_HISTORY_BYTES = 32 * 1024 * 1024


class HistoryEntry(BaseModel):
    run_id: str
    step_id: str
    at: datetime
    passed: bool
    content: ContentHash | None = None
    expectations_digest: str
    failed: list[str] = []


def history_path(workflow_dir: Path) -> Path:
    return workflow_dir / "runs" / HISTORY_FILE


def append(workflow_dir: Path, verification: Verification) -> None:
    entry = HistoryEntry(
        run_id=verification.run_id,
        step_id=verification.step_id,
        at=verification.at,
        passed=verification.passed,
        content=verification.content,
        expectations_digest=verification.expectations_digest,
        failed=[r.label for r in verification.results if not r.ok],
    )
    data = (entry.model_dump_json() + "\n").encode()
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(history_path(workflow_dir), flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{history_path(workflow_dir)} is not a regular file")
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read(workflow_dir: Path, step_id: str | None = None) -> list[HistoryEntry]:
    """The history, oldest first (only `step_id`'s when given)."""
    try:
        fd = os.open(
            history_path(workflow_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        )
    except OSError:
        return []
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return []
        data = handle.read(MAX_HISTORY_BYTES)
    out: list[HistoryEntry] = []
    for raw in data.splitlines():
        try:
            entry = HistoryEntry.model_validate_json(raw)
        except ValidationError:
            continue
        if step_id is None or entry.step_id == step_id:
            out.append(entry)
    return out
