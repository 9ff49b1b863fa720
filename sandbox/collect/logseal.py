"""The seal: the runner syncs the guard's action log before the record says what it holds.

The guard syncs its log in group commit and at its orderly stop, but a guard that was
killed or lied about it syncs nothing, and the record must not depend on it. So once the
guard is gone, the runner (which owns the record; the log file is the guard's uid's)
opens the log read-only, from the run root's fd without following a link, checks it is
a regular file, and `fdatasync`s it: on Linux a sync needs no write access, and it
covers every page of the file whoever wrote it. Only then does the record get
`log_synced_at`; verify, gate and report refuse a record without it.
"""

from __future__ import annotations

import os
import stat
from datetime import UTC, datetime
from pathlib import Path

from sandbox.hostfs import fdtree

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def seal_log(root: Path, name: str) -> datetime:
    """Sync `root/name` (the action log) to disk; the time it was synced. Raises
    OSError when it cannot be opened, is not a regular file, or the sync fails: the
    record then stays unsealed, and the run verifies nothing."""
    root_fd = fdtree.open_root(root)
    try:
        fd = os.open(name, _FLAGS, dir_fd=root_fd)
    finally:
        os.close(root_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name} is not a regular file")
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return datetime.now(UTC)
