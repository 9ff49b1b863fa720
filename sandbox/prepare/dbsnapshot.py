"""The DB snapshot helper: lock the workflow DB as a SQLite reader, copy its files, let go.

Run by `sandbox.prepare.dbcopy` as its own short-lived process
(`python -m sandbox.prepare.dbsnapshot SRC OUTDIR TIMEOUT`): POSIX record locks belong
to the process, so closing any fd on the DB inode in the runner would silently drop the
locks of SQLite connections the runner may hold on the same DB. Standard library only,
so it starts in ~25 ms.
Prints one JSON line: {"ok": true} or {"ok": false, "error": ...}.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import sys
import time
from typing import Any, Final

from sandbox.hostfs.fdcopy import copy_fd

# SQLite's unix VFS lock layout (os_unix.c / wal.c); stable file-format constants.
_PENDING_BYTE: Final = 0x40000000
_SHARED_FIRST: Final = _PENDING_BYTE + 2
_SHARED_SIZE: Final = 510
_SHM_BASE: Final = 120  # (22 + SQLITE_SHM_NLOCK) * 4
_SHM_READ_LOCK0: Final = _SHM_BASE + 3  # WAL_READ_LOCK(0)

_SIDE_FILES: Final = ("-wal", "-journal")
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class _Busy(Exception):
    pass


def _try_read_lock(fd: int, start: int, length: int) -> None:
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, length, start, os.SEEK_SET)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise _Busy from exc
        raise


def _open_regular(path: str) -> int | None:
    """Open ``path`` read-only without following; None if absent; OSError if not regular."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(exc.errno, "is a symlink (not followed)", path) from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


def _copy_to(fd: int, dest: str) -> None:
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        copy_fd(fd, out)
    finally:
        os.close(out)


def _snapshot_once(src: str, outdir: str) -> None:
    """One attempt: lock like a SQLite reader, copy, unlock. Raises _Busy to retry."""
    db_fd = _open_regular(src)
    if db_fd is None:
        raise FileNotFoundError(errno.ENOENT, "no such file", src)
    shm_fd: int | None = None
    try:
        # SHARED lock exactly as unixLock() takes it: read-lock PENDING, read-lock the shared
        # range, drop PENDING. Blocks rollback-mode writers from committing and the last WAL
        # connection from checkpointing and deleting the WAL on close.
        _try_read_lock(db_fd, _PENDING_BYTE, 1)
        _try_read_lock(db_fd, _SHARED_FIRST, _SHARED_SIZE)
        fcntl.lockf(db_fd, fcntl.LOCK_UN, 1, _PENDING_BYTE, os.SEEK_SET)
        # A shared WAL_READ_LOCK(0) stops every checkpoint from backfilling into db.sqlite;
        # writers can still append to the WAL, which recovery of the copy handles.
        shm_fd = _open_regular(src + "-shm")
        if shm_fd is not None:
            _try_read_lock(shm_fd, _SHM_READ_LOCK0, 1)
        _copy_to(db_fd, os.path.join(outdir, "db.sqlite"))
        for suffix in _SIDE_FILES:
            fd = _open_regular(src + suffix)
            if fd is not None:
                try:
                    _copy_to(fd, os.path.join(outdir, "db.sqlite" + suffix))
                finally:
                    os.close(fd)
        if shm_fd is None and os.path.lexists(src + "-shm"):
            # A connection opened the WAL DB while we copied (it cannot delete the -shm
            # while we hold SHARED), so a checkpoint may have run: start over.
            for name in os.listdir(outdir):
                os.unlink(os.path.join(outdir, name))
            raise _Busy
    finally:
        # Closing releases our record locks (this helper holds no other fds on these files).
        if shm_fd is not None:
            os.close(shm_fd)
        os.close(db_fd)


def _helper_main(argv: list[str]) -> int:
    src, outdir, timeout = argv[0], argv[1], float(argv[2])
    deadline = time.monotonic() + timeout
    delay = 0.005
    result: dict[str, Any]
    while True:
        try:
            _snapshot_once(src, outdir)
            result = {"ok": True}
            break
        except _Busy:
            if time.monotonic() >= deadline:
                result = {
                    "ok": False,
                    "error": f"database is locked (SQLITE_BUSY): another connection held a"
                    f" conflicting lock for the whole busy timeout of {timeout:g}s",
                }
                break
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.1)
        except OSError as exc:
            where = exc.filename or src
            result = {"ok": False, "error": f"{where}: {exc.strerror or exc}"}
            break
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(_helper_main(sys.argv[1:]))
