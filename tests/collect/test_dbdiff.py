"""diff_databases on real SQLite files, including hostile ``after`` files."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

from sandbox.collect.dbdiff import diff_databases
from sandbox.contracts.reports import DbDiff, RowChange, TableDiff

EVIL = 'we"ird \'name"; DROP TABLE proposals; --'
EVIL_COL = 'co"l'


def _exec(db: Path, *sql: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        for s in sql:
            conn.execute(s)
    finally:
        conn.close()


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    before = tmp_path / ".db-baseline.sqlite"
    q_evil = '"' + EVIL.replace('"', '""') + '"'
    q_col = '"' + EVIL_COL.replace('"', '""') + '"'
    _exec(
        before,
        "CREATE TABLE proposals (id INTEGER PRIMARY KEY, status TEXT, title TEXT)",
        "INSERT INTO proposals VALUES (3, 'open', 'three'), (7, 'open', 'seven'),"
        " (8, 'done', 'eight')",
        "CREATE TABLE notes (body TEXT, n INTEGER)",  # no PK: rows by content
        "INSERT INTO notes VALUES ('first', 1), ('second', 2), ('third', 3)",
        "CREATE TABLE kv (k TEXT PRIMARY KEY, v) WITHOUT ROWID",
        "INSERT INTO kv VALUES ('a', 1), ('b', 2)",
        "CREATE TABLE old_stuff (id INTEGER PRIMARY KEY, x)",
        "INSERT INTO old_stuff VALUES (1, 'gone')",
        f"CREATE TABLE {q_evil} (id INTEGER PRIMARY KEY, {q_col} TEXT)",
        f"INSERT INTO {q_evil} VALUES (1, 'v1')",
    )
    after = tmp_path / "db" / "db.sqlite"
    after.parent.mkdir()
    shutil.copyfile(before, after)
    return before, after


def _table(d: DbDiff, name: str) -> TableDiff:
    return next(t for t in d.tables if t.name == name)


def test_inserted_updated_deleted_by_pk_rowid_and_without_rowid(tmp_path: Path) -> None:
    before, after = _pair(tmp_path)
    q_evil = '"' + EVIL.replace('"', '""') + '"'
    q_col = '"' + EVIL_COL.replace('"', '""') + '"'
    _exec(
        after,
        "INSERT INTO proposals VALUES (42, 'open', 'new job')",
        "UPDATE proposals SET status = 'claimed' WHERE id = 7",
        "DELETE FROM proposals WHERE id = 3",
        "UPDATE notes SET n = 20 WHERE rowid = 2",
        "DELETE FROM notes WHERE rowid = 1",
        "INSERT INTO notes VALUES ('fourth', 4)",
        "UPDATE kv SET v = 'changed' WHERE k = 'b'",
        "INSERT INTO kv VALUES ('c', x'00ff')",
        f"UPDATE {q_evil} SET {q_col} = 'it''s \"quoted\"' WHERE id = 1",
        f"INSERT INTO {q_evil} VALUES (2, 'v2')",
    )
    before_hash = hashlib.sha256(before.read_bytes()).hexdigest()
    after_hash = hashlib.sha256(after.read_bytes()).hexdigest()

    d = diff_databases(before, after)

    assert d.error is None
    p = _table(d, "proposals")
    assert (p.inserted, p.updated, p.deleted) == (1, 1, 1)
    assert p.key_columns == ["id"] and not p.truncated
    assert p.rows == [
        RowChange(
            kind="inserted", key={"id": 42}, row={"id": 42, "status": "open", "title": "new job"}
        ),
        RowChange(kind="updated", key={"id": 7}, changes={"status": ("open", "claimed")}),
        RowChange(kind="deleted", key={"id": 3}, row={"id": 3, "status": "open", "title": "three"}),
    ]
    # No primary key: rows are their content (a multiset), so an UPDATE is a delete
    # of the old content and an insert of the new one.
    n = _table(d, "notes")
    assert n.key_columns == []
    assert (n.inserted, n.updated, n.deleted) == (2, 0, 2)
    assert [(r.kind, r.key, r.row) for r in n.rows] == [
        ("inserted", {}, {"body": "fourth", "n": 4}),
        ("inserted", {}, {"body": "second", "n": 20}),
        ("deleted", {}, {"body": "first", "n": 1}),
        ("deleted", {}, {"body": "second", "n": 2}),
    ]
    kv = _table(d, "kv")
    assert (kv.inserted, kv.updated, kv.deleted) == (1, 1, 0)
    assert kv.rows[0].row == {"k": "c", "v": "x'00ff'"}
    assert kv.rows[1].changes == {"v": (2, "changed")}
    evil = _table(d, EVIL)
    assert (evil.inserted, evil.updated, evil.deleted) == (1, 1, 0)
    assert evil.rows[1].changes == {EVIL_COL: ("v1", 'it\'s "quoted"')}
    assert d.tables_compared == 5 and not d.schema_changed
    assert d.tables_added == [] and d.tables_dropped == []

    lines = d.summary_lines()
    assert (
        "proposals: 1 inserted (id=42), 1 updated (id=7: status 'open' -> 'claimed'),"
        " 1 deleted (id=3)"
    ) in lines
    assert (
        "notes: 2 inserted (body='fourth' n=4, body='second' n=20),"
        " 2 deleted (body='first' n=1, body='second' n=2)"
    ) in lines
    d.model_dump_json()
    # Both inputs were only read.
    assert hashlib.sha256(before.read_bytes()).hexdigest() == before_hash
    assert hashlib.sha256(after.read_bytes()).hexdigest() == after_hash
    assert sorted(os.listdir(after.parent)) == ["db.sqlite"]


def test_tables_added_dropped_and_schema_changes(tmp_path: Path) -> None:
    before, after = _pair(tmp_path)
    _exec(
        after,
        "DROP TABLE old_stuff",
        "CREATE TABLE new_stuff (id INTEGER PRIMARY KEY, x TEXT)",
        "INSERT INTO new_stuff VALUES (1, 'a'), (2, 'b')",
        "ALTER TABLE proposals ADD COLUMN owner TEXT",
        "UPDATE proposals SET owner = 'bot' WHERE id = 8",
        "CREATE INDEX idx_status ON proposals (status)",
    )
    d = diff_databases(before, after)
    assert d.error is None
    assert d.tables_added == ["new_stuff"] and d.tables_dropped == ["old_stuff"]
    assert d.schema_changed == ["proposals"]
    assert d.other_schema_changes == ["index added: idx_status"]
    added = _table(d, "new_stuff")
    assert added.status == "added" and added.inserted == 2
    assert [r.row for r in added.rows] == [{"id": 1, "x": "a"}, {"id": 2, "x": "b"}]
    dropped = _table(d, "old_stuff")
    assert dropped.status == "dropped" and dropped.deleted == 1
    # A new column is not an update of the common columns.
    assert all(t.name != "proposals" for t in d.tables)
    lines = d.summary_lines()
    assert "new_stuff (table added): 2 inserted (id=1, id=2)" in lines
    assert "old_stuff (table dropped): 1 deleted (id=1)" in lines
    assert "schema changed: proposals" in lines


def test_no_changes_and_row_cap_with_exact_counts(tmp_path: Path) -> None:
    before, after = _pair(tmp_path)
    same = diff_databases(before, after)
    assert same.error is None and not same.changed
    assert same.summary_lines() == ["no database changes"]

    _exec(
        after,
        "WITH RECURSIVE n(i) AS (SELECT 100 UNION ALL SELECT i + 1 FROM n WHERE i < 149)"
        " INSERT INTO proposals SELECT i, 'open', 'bulk' FROM n",
        "UPDATE proposals SET title = 'x' || title WHERE id IN (7, 8)",
    )
    d = diff_databases(before, after, max_rows_per_table=4)
    p = _table(d, "proposals")
    assert (p.inserted, p.updated) == (50, 2)
    assert len(p.rows) == 4 and p.truncated
    assert [r.key["id"] for r in p.rows] == [100, 101, 102, 103]
    assert d.summary_lines()[0].startswith(
        "proposals: 50 inserted (id=100, id=101, id=102, id=103, +46 more), 2 updated ("
    )


def test_long_values_are_truncated_and_blobs_hex(tmp_path: Path) -> None:
    before, after = _pair(tmp_path)
    _exec(
        after,
        f"INSERT INTO kv VALUES ('long', '{'z' * 500}')",
        "INSERT INTO kv VALUES ('blob', randomblob(1000))",
    )
    d = diff_databases(before, after)
    rows = {r.key["k"]: r.row for r in _table(d, "kv").rows}
    assert rows["long"] is not None and rows["blob"] is not None
    long_v = rows["long"]["v"]
    assert isinstance(long_v, str) and long_v == "z" * 200 + "…"
    blob_v = rows["blob"]["v"]
    assert isinstance(blob_v, str) and blob_v.startswith("x'") and blob_v.endswith("'…")
    assert len(blob_v) == len("x''…") + 64


def test_committed_wal_rows_of_the_after_file_count(tmp_path: Path) -> None:
    before, after = _pair(tmp_path)
    # The step's process dies without checkpointing: its rows sit in db.sqlite-wal.
    crash = (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA journal_mode = WAL')\n"
        "c.execute('PRAGMA wal_autocheckpoint = 0')\n"
        "c.execute(\"INSERT INTO proposals VALUES (99, 'open', 'from wal')\")\n"
        "c.execute('BEGIN')\n"
        "c.execute(\"INSERT INTO proposals VALUES (100, 'open', 'uncommitted')\")\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", crash, str(after)], check=True, timeout=60)
    files = {p.name: p.read_bytes() for p in after.parent.iterdir()}
    assert "db.sqlite-wal" in files
    d = diff_databases(before, after)
    assert d.error is None
    p = _table(d, "proposals")
    assert (p.inserted, p.updated, p.deleted) == (1, 0, 0)
    assert p.rows[0].key == {"id": 99}
    assert {p.name: p.read_bytes() for p in after.parent.iterdir()} == files


def test_not_a_database_after_file(tmp_path: Path) -> None:
    before, after = _pair(tmp_path)
    after.write_bytes(os.urandom(8192))
    d = diff_databases(before, after)
    assert d.error is not None and "not a database" in d.error
    assert d.tables == []
    assert d.summary_lines()[0].startswith("database diff failed:")


def test_corrupt_after_file(tmp_path: Path) -> None:
    before, after = _pair(tmp_path)
    _exec(
        after,
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000)"
        " INSERT INTO notes SELECT printf('row %d padded %0200d', i, i), i FROM n",
    )
    data = bytearray(after.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    for pg in range(2, len(data) // page):  # scribble over every page but the header page
        data[pg * page + 8 : pg * page + 40] = b"\xff" * 32
    after.write_bytes(bytes(data))
    d = diff_databases(before, after)
    assert d.error is not None
    assert "corrupt" in d.error or "malformed" in d.error
    assert d.tables == [] and d.summary_lines()[0].startswith("database diff failed:")


def test_symlinked_or_missing_after_file(tmp_path: Path) -> None:
    before, after = _pair(tmp_path)
    os.unlink(after)
    d = diff_databases(before, after)
    assert d.error is not None and "does not exist" in d.error
    after.symlink_to(before)
    d = diff_databases(before, after)
    assert d.error is not None and "symlink" in d.error
    os.unlink(after)
    os.mkfifo(after)  # opening it must not hang
    d = diff_databases(before, after)
    assert d.error is not None and "not a regular file" in d.error
    # A planted -wal symlink next to a real file is ignored, never followed.
    os.unlink(after)
    shutil.copyfile(before, after)
    Path(str(after) + "-wal").symlink_to("/etc/passwd")
    d = diff_databases(before, after)
    assert d.error is None and not d.changed
    assert any("symlink" in note for note in d.notes)


def test_too_large_after_file(tmp_path: Path) -> None:
    before, after = _pair(tmp_path)
    d = diff_databases(before, after, max_bytes=1024)
    assert d.error is not None and "too large" in d.error


def test_time_limit_becomes_an_error(tmp_path: Path) -> None:
    before, after = _pair(tmp_path)
    _exec(
        after,
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 5000)"
        " INSERT INTO notes SELECT 'r', i FROM n",
    )
    d = diff_databases(before, after, timeout_s=0)
    assert d.error is not None and "took longer than" in d.error
