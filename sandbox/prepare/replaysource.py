"""The recording a replay serves from: found, read without following any link, checked
and copied into the new run's guard folder (`guard/replay/`, root's, read-only to
the guard).

Nothing from the source run folder is trusted: each name is opened below a
directory descriptor with O_NOFOLLOW, only regular files are read, at most
`MAX_INDEX_BYTES` of index and the new run's recording cap of answers are
copied, and an answer is copied only when its size and SHA-256 are what its
index line says (one that is not becomes a miss). The record names the source
by its run id and the SHA-256 of its index as read here.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from sandbox.contracts.errors import ConfigError
from sandbox.contracts.layout import GUARD_DIR, make_private_dir
from sandbox.contracts.record import TestRunRecord
from sandbox.contracts.recording import (
    BLOBS_DIR,
    INDEX_FILE,
    MAX_INDEX_BYTES,
    RECORDING_DIR,
    IndexLine,
    MissMode,
    ReplaySummary,
)
from sandbox.contracts.status import RECORD_FILE

MAX_RECORD_BYTES = 32 * 1024**2
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass(frozen=True)
class ReplaySource:
    """A finished test run whose recording a new run replays."""

    run_root: Path
    miss: MissMode = "stub"


def find_source(workflow_dir: Path, run: str, miss: MissMode) -> ReplaySource:
    """RUN as a run folder, or a run id under the workflow's runs/."""
    path = Path(run)
    if not path.is_dir():
        path = workflow_dir / "runs" / run
    if not path.is_dir() or path.is_symlink():
        raise ConfigError(f"--replay {run}: no such test run (a run folder or a run id)")
    return ReplaySource(run_root=path, miss=miss)


def _read_at(dir_fd: int, name: str, limit: int) -> bytes:
    """A regular file below `dir_fd`, at most `limit` bytes (OSError past it)."""
    fd = os.open(name, _FILE, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name} is not a regular file")
        chunks, size = [], 0
        while chunk := os.read(fd, 1024 * 1024):
            size += len(chunk)
            if size > limit:
                raise OSError(f"{name} is larger than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _open_dirs(root: Path, *names: str) -> list[int]:
    fds = [os.open(root, _DIR)]
    try:
        for name in names:
            fds.append(os.open(name, _DIR, dir_fd=fds[-1]))
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def copy_recording(source: ReplaySource, dest: Path, cap_bytes: int) -> ReplaySummary:
    """The source's checked answers into `dest` (index.jsonl and blobs/); the summary the
    record starts from. A source without a readable recording is a configuration error."""
    try:
        fds = _open_dirs(source.run_root)
        try:
            record = TestRunRecord.model_validate_json(
                _read_at(fds[0], RECORD_FILE, MAX_RECORD_BYTES)
            )
        finally:
            os.close(fds[0])
        fds = _open_dirs(source.run_root, GUARD_DIR, RECORDING_DIR)
    except (OSError, ValidationError) as exc:
        raise ConfigError(
            f"--replay {source.run_root}: not a test run with a recording ({exc})"
        ) from None
    try:
        try:
            index = _read_at(fds[-1], INDEX_FILE, MAX_INDEX_BYTES)
        except OSError as exc:
            reason = f"--replay {source.run_root}: its recording is unreadable ({exc})"
            raise ConfigError(reason) from None
        blobs = os.open(BLOBS_DIR, _DIR, dir_fd=fds[-1])
        fds.append(blobs)
        make_private_dir(dest, 0o755)
        make_private_dir(dest / BLOBS_DIR, 0o755)
        kept: list[bytes] = []
        copied: set[str] = set()
        total = 0
        for raw in index.splitlines():
            try:
                line = IndexLine.model_validate_json(raw)
            except ValidationError:
                continue
            if not line.kept or line.sha256 is None:
                continue
            if line.sha256 not in copied:
                if total + line.bytes > cap_bytes:
                    continue
                try:
                    data = _read_at(blobs, line.sha256, line.bytes)
                except OSError:
                    continue
                if len(data) != line.bytes or hashlib.sha256(data).hexdigest() != line.sha256:
                    continue
                _write_new(dest / BLOBS_DIR / line.sha256, data)
                copied.add(line.sha256)
                total += line.bytes
            kept.append(line.model_dump_json().encode())
        _write_new(dest / INDEX_FILE, b"".join(k + b"\n" for k in kept))
    finally:
        for fd in fds:
            os.close(fd)
    return ReplaySummary(
        run_id=record.id,
        index_sha256=hashlib.sha256(index).hexdigest(),
        miss_mode=source.miss,
    )


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
