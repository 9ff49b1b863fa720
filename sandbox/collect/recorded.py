"""The record's account of the run's recording, and of its replay, read from the index
the guard wrote (`guard/recording/index.jsonl`) once the guard has stopped.

Read without following a link (each name below a directory descriptor, O_NOFOLLOW,
a regular file only) and at most `MAX_INDEX_BYTES`; a line that does not parse is
skipped. The blobs are not read here: sizes and names are the guard's, and the
replaying host checks each blob against its index line before it serves it.
"""

from __future__ import annotations

import hashlib
import os
import stat

from pydantic import ValidationError

from sandbox.contracts.layout import RunLayout
from sandbox.contracts.record import TestRunRecord
from sandbox.contracts.recording import (
    INDEX_FILE,
    MAX_INDEX_BYTES,
    MAX_MISSES_NAMED,
    MAX_NOT_KEPT_KEYS,
    RECORDING_DIR,
    IndexLine,
    NotKept,
    RecordingSettings,
    RecordingSummary,
    ReplayMiss,
)

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def read_index(layout: RunLayout) -> bytes:
    """The index's bytes (OSError: missing, not a regular file, or past the cap)."""
    guard = os.open(layout.guard_dir, _DIR)
    try:
        folder = os.open(RECORDING_DIR, _DIR, dir_fd=guard)
        try:
            fd = os.open(INDEX_FILE, _FILE, dir_fd=folder)
        finally:
            os.close(folder)
    finally:
        os.close(guard)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("the index is not a regular file")
        data = os.read(fd, MAX_INDEX_BYTES + 1)
        while len(data) <= MAX_INDEX_BYTES and (more := os.read(fd, MAX_INDEX_BYTES + 1)):
            data += more
        if len(data) > MAX_INDEX_BYTES:
            raise OSError(f"the index is larger than {MAX_INDEX_BYTES} bytes")
        return data
    finally:
        os.close(fd)


def summarize(layout: RunLayout, settings: RecordingSettings, record: TestRunRecord) -> None:
    """`record.recording` (and the counts of `record.replay`) from the guard's index."""
    summary = RecordingSummary(cap_bytes=settings.cap_bytes, body_cap_bytes=settings.body_cap_bytes)
    record.recording = summary
    if not settings.enabled:
        summary.error = "recording is off"
        return
    try:
        data = read_index(layout)
    except FileNotFoundError:
        return  # the run made no read
    except OSError as exc:
        summary.error = f"the recording's index could not be read: {exc}"
        return
    summary.index_sha256 = hashlib.sha256(data).hexdigest()
    kept: set[str] = set()
    live: set[str] = set()
    misses: list[IndexLine] = []
    replay = record.replay
    for raw in data.splitlines():
        try:
            line = IndexLine.model_validate_json(raw)
        except ValidationError:
            continue
        if line.replay == "miss":
            misses.append(line)
            continue
        if line.replay == "live":
            live.add(line.key)
        if line.replay == "hit" and replay is not None:
            replay.hits += 1
        if line.kept and line.sha256 is not None:
            summary.kept += 1
            if line.sha256 not in kept:  # one copy of the same answer
                kept.add(line.sha256)
                summary.kept_bytes += line.bytes
        else:
            summary.not_kept += 1
            summary.not_kept_bytes += line.bytes
            if len(summary.not_kept_named) < MAX_NOT_KEPT_KEYS:
                summary.not_kept_named.append(
                    NotKept(key=line.key, what=line.what, bytes=line.bytes, why=line.why_not)
                )
    if replay is not None:
        replay.misses = len(misses)
        replay.misses_named = [
            ReplayMiss(kind=m.kind, what=m.what, key=m.key, went_live=m.key in live)
            for m in misses[:MAX_MISSES_NAMED]
        ]
