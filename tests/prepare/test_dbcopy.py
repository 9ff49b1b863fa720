"""copy_db on real SQLite files: WAL consistency, byte-identity of the real db/, errors."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox.prepare.dbcopy import DbCopyError, copy_db, find_workflow_db


def _state(db_dir: Path) -> dict[str, str]:
    """Every file in the real db/ folder and its sha256: must not change at all."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(db_dir.iterdir())}


def _values(db: Path) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        return [r[0] for r in conn.execute("SELECT v FROM t ORDER BY id")]
    finally:
        conn.close()


def _wal_db(tmp_path: Path) -> tuple[Path, sqlite3.Connection]:
    db = tmp_path / "wf" / "db" / "db.sqlite"
    db.parent.mkdir(parents=True)
    w = sqlite3.connect(db, isolation_level=None)
    assert w.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal"
    w.execute("PRAGMA wal_autocheckpoint = 0")
    w.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    w.execute("INSERT INTO t (v) VALUES ('base')")
    w.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return db, w


def test_wal_copy_has_committed_rows_not_uncommitted_and_db_dir_is_untouched(
    tmp_path: Path,
) -> None:
    db, w = _wal_db(tmp_path)
    try:
        w.execute("INSERT INTO t (v) VALUES ('committed-1'), ('committed-2')")
        # The committed rows live only in the WAL: the main file alone does not have them.
        main_only = tmp_path / "main_only.sqlite"
        shutil.copyfile(db, main_only)
        assert _values(main_only) == ["base"]

        # An open write transaction whose uncommitted pages spill into the WAL file.
        w.execute("PRAGMA cache_size = 5")
        wal_before_txn = os.path.getsize(str(db) + "-wal")
        w.execute("BEGIN IMMEDIATE")
        w.executemany(
            "INSERT INTO t (v) VALUES (?)", [(f"uncommitted-{i}-" + "x" * 400,) for i in range(500)]
        )
        assert os.path.getsize(str(db) + "-wal") > wal_before_txn  # uncommitted frames on disk

        before = _state(db.parent)
        assert set(before) == {"db.sqlite", "db.sqlite-wal", "db.sqlite-shm"}
        dst = tmp_path / "runs" / "test-1" / "db" / "db.sqlite"
        rep = copy_db(db, dst, timeout_s=10)
        after = _state(db.parent)

        assert after == before  # db.sqlite, -wal AND -shm byte-identical, no new files
        assert _values(dst) == ["base", "committed-1", "committed-2"]
        assert rep.tables == 1 and rep.method == "vacuum_into"
        assert rep.bytes == os.path.getsize(dst) and rep.dest == str(dst)
        assert os.listdir(dst.parent) == ["db.sqlite"]  # private snapshot removed

        # The writer is unaffected: it can still commit, and a new copy sees everything.
        w.execute("COMMIT")
        dst2 = tmp_path / "copy2.sqlite"
        copy_db(db, dst2, timeout_s=10)
        assert len(_values(dst2)) == 3 + 500
    finally:
        w.close()


def test_quiescent_wal_db_gets_no_wal_or_shm_created(tmp_path: Path) -> None:
    db, w = _wal_db(tmp_path)
    w.execute("INSERT INTO t (v) VALUES ('more')")
    w.close()  # last connection: checkpoints and removes -wal and -shm
    before = _state(db.parent)
    assert list(before) == ["db.sqlite"]
    copy_db(db, tmp_path / "out.sqlite")
    assert _state(db.parent) == before
    assert _values(tmp_path / "out.sqlite") == ["base", "more"]


def test_hot_journal_is_rolled_back_in_the_copy_only(tmp_path: Path) -> None:
    db = tmp_path / "db" / "db.sqlite"
    db.parent.mkdir()
    c = sqlite3.connect(db, isolation_level=None)
    c.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    c.execute("INSERT INTO t (v) VALUES ('kept')")
    c.close()
    crash = (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA cache_size = 5')\n"
        "c.execute('BEGIN')\n"
        "c.executemany('INSERT INTO t (v) VALUES (?)', [('lost' + 'y' * 400,)] * 500)\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", crash, str(db)], check=True, timeout=60)
    before = _state(db.parent)
    assert "db.sqlite-journal" in before  # a hot journal left by the crashed writer
    copy_db(db, tmp_path / "out.sqlite")
    assert _state(db.parent) == before  # the real journal was NOT rolled back in place
    assert _values(tmp_path / "out.sqlite") == ["kept"]


def test_not_a_database(tmp_path: Path) -> None:
    db = tmp_path / "db" / "db.sqlite"
    db.parent.mkdir()
    db.write_bytes(b"this is not sqlite " * 300)
    dst = tmp_path / "out" / "db.sqlite"
    with pytest.raises(DbCopyError, match="not a database") as err:
        copy_db(db, dst)
    assert str(db) in str(err.value)
    assert os.listdir(dst.parent) == []  # no partial copy, no private snapshot left


def test_busy_is_bounded_and_reported(tmp_path: Path) -> None:
    db = tmp_path / "db" / "db.sqlite"
    db.parent.mkdir()
    w = sqlite3.connect(db, isolation_level=None)  # rollback journal mode
    try:
        w.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
        w.execute("BEGIN EXCLUSIVE")
        w.execute("INSERT INTO t (v) VALUES ('row')")
        start = time.monotonic()
        with pytest.raises(DbCopyError, match="locked") as err:
            copy_db(db, tmp_path / "out.sqlite", timeout_s=0.5)
        elapsed = time.monotonic() - start
        assert 0.5 <= elapsed < 20
        assert "SQLITE_BUSY" in str(err.value) and str(db) in str(err.value)
        assert not (tmp_path / "out.sqlite").exists()
        w.execute("COMMIT")
    finally:
        w.close()
    copy_db(db, tmp_path / "out.sqlite", timeout_s=5)
    assert _values(tmp_path / "out.sqlite") == ["row"]


def test_find_workflow_db_and_missing_or_symlinked_sources(tmp_path: Path) -> None:
    wf = tmp_path / "wf"
    wf.mkdir()
    assert find_workflow_db(wf) is None
    with pytest.raises(DbCopyError, match="no such file"):
        copy_db(wf / "db" / "db.sqlite", tmp_path / "out.sqlite")

    real = tmp_path / "real.sqlite"
    sqlite3.connect(real).close()
    (wf / "db").mkdir()
    (wf / "db" / "db.sqlite").symlink_to(real)
    with pytest.raises(DbCopyError, match="symlink"):
        find_workflow_db(wf)
    with pytest.raises(DbCopyError, match="symlink"):
        copy_db(wf / "db" / "db.sqlite", tmp_path / "out.sqlite")

    os.unlink(wf / "db" / "db.sqlite")
    shutil.copyfile(real, wf / "db" / "db.sqlite")
    assert find_workflow_db(wf) == wf / "db" / "db.sqlite"


def test_existing_destination_is_refused(tmp_path: Path) -> None:
    db, w = _wal_db(tmp_path)
    w.close()
    dst = tmp_path / "out.sqlite"
    dst.write_bytes(b"keep me")
    with pytest.raises(DbCopyError, match="already exists"):
        copy_db(db, dst)
    assert dst.read_bytes() == b"keep me"
