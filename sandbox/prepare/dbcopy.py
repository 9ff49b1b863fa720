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
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sandbox.contracts.errors import PrepareError
from sandbox.contracts.reports import DbCopyReport

__all__ = ["DbCopyError", "copy_db", "find_workflow_db"]

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


class DbCopyError(PrepareError):
    """The workflow DB could not be copied (busy, unreadable, corrupt, not a database)."""


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
    import sqlite3  # here: a run without a DB (most) never loads it

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
    # The helper imports only the standard library (sandbox.prepare.dbsnapshot): ~25 ms to start.
    proc = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "sandbox.prepare.dbsnapshot",
            str(src),
            str(outdir),
            repr(float(timeout_s)),
        ],
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
