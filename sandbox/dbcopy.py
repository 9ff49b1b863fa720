"""Consistent copy of the workflow DB with ``VACUUM INTO``, never touching the real ``db/``.

Guarantees: the copy holds every transaction committed up to an instant during the copy
(committed WAL rows included, uncommitted ones never), and the real ``db.sqlite``, ``-wal`` and
``-shm`` stay byte-identical with no file created next to them. Not guaranteed: DBs on file
systems without POSIX record locks, and a lock conflict lasting longer than ``timeout_s``
(``locking_mode=EXCLUSIVE`` writers, long rollback-mode write transactions) is a
:class:`DbCopyError`, not a wait.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel

from sandbox.copytree import copy_fd
from sandbox.errors import PrepareError

__all__ = ["DbCopyError", "DbCopyReport", "copy_db", "find_workflow_db"]

# How (measured on SQLite 3.40): a ``mode=ro`` connection is NOT enough. It rewrites the -shm
# read marks while another connection is open, and on a quiescent WAL DB it *creates* -wal and
# -shm and leaves them behind. So SQLite never opens the real files. A short-lived helper
# process takes the advisory locks a SQLite reader takes (SHARED on the DB file; a shared
# WAL_READ_LOCK(0) on the -shm, which makes every checkpoint back-fill nothing, verified),
# copies db.sqlite, -wal and -journal byte for byte into a private temp dir and lets go. SQLite
# then recovers that private copy (committed WAL frames in; uncommitted or torn frames out; a
# hot journal rolled back) and VACUUM INTO writes the result. The helper is a separate process
# because POSIX record locks belong to the process: closing any fd on the DB inode here would
# silently drop the locks of SQLite connections this process may hold on the same DB.

# SQLite's unix VFS lock layout (os_unix.c / wal.c); stable file-format constants.
_PENDING_BYTE: Final = 0x40000000
_SHARED_FIRST: Final = _PENDING_BYTE + 2
_SHARED_SIZE: Final = 510
_SHM_BASE: Final = 120  # (22 + SQLITE_SHM_NLOCK) * 4
_SHM_READ_LOCK0: Final = _SHM_BASE + 3  # WAL_READ_LOCK(0)

_SIDE_FILES: Final = ("-wal", "-journal")
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class DbCopyError(PrepareError):
    """The workflow DB could not be copied (busy, unreadable, corrupt, not a database)."""


class DbCopyReport(BaseModel):
    """What :func:`copy_db` produced."""

    source: str
    dest: str
    bytes: int
    tables: int
    method: Literal["vacuum_into"] = "vacuum_into"
    seconds: float


def find_workflow_db(workflow_dir: Path) -> Path | None:
    """``<workflow>/db/db.sqlite`` if it exists, else None (no DB means no DB access).

    Raises :class:`DbCopyError` if it exists but is a symlink or not a regular file: it is
    neither followed nor silently treated as "no DB".
    """
    path = workflow_dir / "db" / "db.sqlite"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DbCopyError(f"cannot inspect workflow DB {path}: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise DbCopyError(f"workflow DB {path} is {what}; refusing to use it")
    return path


def copy_db(src: Path, dst: Path, *, timeout_s: float = 30.0) -> DbCopyReport:
    """Copy the SQLite DB ``src`` to the new file ``dst`` (see the module doc for guarantees).

    ``dst`` must not exist; its parent is created if missing. Waits at most ``timeout_s`` for
    the locks (``SQLITE_BUSY``), then raises :class:`DbCopyError`; also raises it for a missing,
    unreadable or corrupt source ("file is not a database", ...), with the path in the message.
    """
    started = time.monotonic()
    src = Path(src)
    dst = Path(dst)
    if os.path.lexists(dst):
        raise DbCopyError(f"DB copy destination {dst} already exists")
    dst.parent.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=".dbcopy-", dir=dst.parent))
    created_dst = False
    try:
        _run_snapshot_helper(src, private, timeout_s)
        conn = sqlite3.connect(private / "db.sqlite", timeout=timeout_s, isolation_level=None)
        try:
            row = conn.execute(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table'"
                " AND lower(substr(name, 1, 7)) <> 'sqlite_'"
            ).fetchone()
            tables = int(row[0])
            created_dst = True
            conn.execute("VACUUM INTO ?", (str(dst),))
        finally:
            conn.close()
        size = os.lstat(dst).st_size
    except sqlite3.Error as exc:
        if created_dst:
            _unlink_quietly(dst)
        code = getattr(exc, "sqlite_errorname", "")
        detail = f"{exc} ({code})" if code else str(exc)
        raise DbCopyError(f"cannot copy workflow DB {src}: {detail}") from exc
    except BaseException:
        if created_dst:
            _unlink_quietly(dst)
        raise
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return DbCopyReport(
        source=str(src),
        dest=str(dst),
        bytes=size,
        tables=tables,
        seconds=round(time.monotonic() - started, 4),
    )


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _run_snapshot_helper(src: Path, outdir: Path, timeout_s: float) -> None:
    code = (
        "import sys\n"
        "from sandbox.dbcopy import _helper_main\n"
        "sys.exit(_helper_main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code, str(src), str(outdir), repr(float(timeout_s))],
        capture_output=True,
        text=True,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    try:
        result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (proc.stderr or proc.stdout).strip()[-500:]
        raise DbCopyError(
            f"cannot copy workflow DB {src}: snapshot helper failed (exit {proc.returncode}):"
            f" {tail}"
        ) from None
    if not result.get("ok"):
        raise DbCopyError(f"cannot copy workflow DB {src}: {result.get('error')}")


# --- helper process ---------------------------------------------------------------------------


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
