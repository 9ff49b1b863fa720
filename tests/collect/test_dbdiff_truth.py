"""The DB diff tells what SQLite stores: the issue's four cases, and an independent oracle.

The oracle is SQLite's own session extension (`sqlite3session_diff`, through apsw's
bundled SQLite): for tables with a primary key it computes the changes that turn the
before table into the after one. Random changes (hypothesis) on BINARY columns must
give the same inserted / updated / deleted rows, keyed the same, with the same changed
columns. (The session extension compares with the column's collation and numerically,
so the random values keep away from NOCASE columns and from an integer equal to a
real; those cases are pinned by the tests above it.)
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Any

import apsw
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sandbox.collect.dbdiff import diff_databases
from sandbox.contracts.reports import DbDiff, TableDiff


def _exec(db: Path, *sql: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        for s in sql:
            conn.execute(s)
    finally:
        conn.close()


def _pair(tmp_path: Path, *sql: str) -> tuple[Path, Path]:
    before = tmp_path / "before.sqlite"
    _exec(before, *sql)
    after = tmp_path / "after.sqlite"
    shutil.copyfile(before, after)
    return before, after


def _table(d: DbDiff, name: str) -> TableDiff:
    found = [t for t in d.tables if t.name == name]
    assert found, f"{name} not in the diff: {d.summary_lines()}"
    return found[0]


# -- the four cases of the issue -------------------------------------------------------------


def test_case_only_change_in_a_nocase_column_is_an_update(tmp_path: Path) -> None:
    before, after = _pair(
        tmp_path,
        "CREATE TABLE colour (id INTEGER PRIMARY KEY, name TEXT COLLATE NOCASE)",
        "INSERT INTO colour VALUES (1, 'Red'), (2, 'Blue')",
    )
    _exec(after, "UPDATE colour SET name = 'RED' WHERE id = 1")
    d = diff_databases(before, after)
    assert d.error is None
    t = _table(d, "colour")
    assert (t.inserted, t.updated, t.deleted) == (0, 1, 0)
    assert t.rows[0].key == {"id": 1} and t.rows[0].changes == {"name": ("Red", "RED")}


def test_case_only_change_of_a_nocase_primary_key_is_a_delete_and_an_insert(
    tmp_path: Path,
) -> None:
    before, after = _pair(
        tmp_path,
        "CREATE TABLE tag (name TEXT COLLATE NOCASE PRIMARY KEY, n INTEGER) WITHOUT ROWID",
        "INSERT INTO tag VALUES ('Red', 1), ('Blue', 2)",
    )
    _exec(after, "UPDATE tag SET name = 'RED' WHERE name = 'Red'")
    d = diff_databases(before, after)
    t = _table(d, "tag")
    assert (t.inserted, t.updated, t.deleted) == (1, 0, 1)
    assert [(r.kind, r.key) for r in t.rows] == [
        ("inserted", {"name": "RED"}),
        ("deleted", {"name": "Red"}),
    ]


def test_an_integer_that_became_a_real_is_an_update(tmp_path: Path) -> None:
    before, after = _pair(
        tmp_path, "CREATE TABLE t (id INTEGER PRIMARY KEY, v)", "INSERT INTO t VALUES (1, 1)"
    )
    _exec(after, "UPDATE t SET v = 1.0 WHERE id = 1")
    t = _table(diff_databases(before, after), "t")
    assert (t.inserted, t.updated, t.deleted) == (0, 1, 0)
    assert t.rows[0].changes == {"v": (1, 1.0)}


def test_delete_then_vacuum_in_a_rowid_table_is_one_delete_of_the_right_row(
    tmp_path: Path,
) -> None:
    before, after = _pair(
        tmp_path,
        "CREATE TABLE note (body TEXT, n INTEGER)",
        "INSERT INTO note VALUES ('first', 1), ('second', 2), ('third', 3)",
    )
    # VACUUM renumbers the rowids of a table without an INTEGER PRIMARY KEY.
    _exec(after, "DELETE FROM note WHERE n = 1", "VACUUM")
    d = diff_databases(before, after)
    t = _table(d, "note")
    assert (t.inserted, t.updated, t.deleted) == (0, 0, 1)
    assert t.rows[0].row == {"body": "first", "n": 1}
    # And a rowid reused by a different row is that row, not an update of the old one.
    (tmp_path / "reuse").mkdir()
    before2, after2 = _pair(
        tmp_path / "reuse",
        "CREATE TABLE note (body TEXT)",
        "INSERT INTO note VALUES ('a'), ('b')",
    )
    _exec(
        after2, "DELETE FROM note WHERE rowid = 2", "INSERT INTO note (rowid, body) VALUES (2, 'c')"
    )
    t2 = _table(diff_databases(before2, after2), "note")
    assert (t2.inserted, t2.updated, t2.deleted) == (1, 0, 1)


def test_a_table_made_through_writable_schema_is_reported(tmp_path: Path) -> None:
    before, after = _pair(
        tmp_path, "CREATE TABLE t (id INTEGER PRIMARY KEY)", "INSERT INTO t VALUES (1)"
    )
    conn = sqlite3.connect(after, isolation_level=None)
    conn.execute("CREATE TABLE carrier (x)")
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'carrier'").fetchone()[0]
    conn.execute("PRAGMA writable_schema = ON")
    # The same b-tree, listed again under a name SQLite reserves for itself.
    conn.execute(
        "INSERT INTO sqlite_master VALUES ('table', 'sqlite_hidden', 'sqlite_hidden', ?, "
        "'CREATE TABLE sqlite_hidden (x)')",
        (root,),
    )
    conn.execute("DELETE FROM sqlite_master WHERE name = 'carrier'")
    conn.execute("PRAGMA writable_schema = OFF")
    conn.close()
    _exec(after, "INSERT INTO sqlite_hidden VALUES ('smuggled')")
    d = diff_databases(before, after)
    assert d.error is None, d.error
    assert "sqlite_hidden" in d.tables_added
    assert _table(d, "sqlite_hidden").inserted == 1
    assert any("sqlite_hidden" in line for line in d.summary_lines())


def test_user_version_application_id_and_journal_mode_are_reported(tmp_path: Path) -> None:
    before, after = _pair(tmp_path, "CREATE TABLE t (id INTEGER PRIMARY KEY)")
    _exec(
        after,
        "PRAGMA user_version = 7",
        "PRAGMA application_id = 1234",
        "PRAGMA journal_mode = WAL",
    )
    d = diff_databases(before, after)
    assert d.error is None
    assert d.pragmas_changed["user_version"] == (0, 7)
    assert d.pragmas_changed["application_id"] == (0, 1234)
    assert d.pragmas_changed["journal_mode"] == ("rollback", "wal")
    assert d.changed
    assert "pragma user_version: 0 -> 7" in d.summary_lines()


def test_index_trigger_and_view_changes_are_reported(tmp_path: Path) -> None:
    before, after = _pair(
        tmp_path,
        "CREATE TABLE t (id INTEGER PRIMARY KEY, v)",
        "CREATE VIEW v1 AS SELECT id FROM t",
        "CREATE INDEX i1 ON t (v)",
    )
    _exec(
        after,
        "DROP VIEW v1",
        "CREATE VIEW v1 AS SELECT v FROM t",
        "DROP INDEX i1",
        "CREATE TRIGGER tr AFTER INSERT ON t BEGIN SELECT 1; END",
    )
    d = diff_databases(before, after)
    assert d.other_schema_changes == [
        "index dropped: i1",
        "trigger added: tr",
        "view changed: v1",
    ]


# -- the oracle ------------------------------------------------------------------------------

SCHEMA = (
    "CREATE TABLE r (id INTEGER PRIMARY KEY, a, b)",
    "CREATE TABLE w (k TEXT, n INTEGER, c, PRIMARY KEY (k, n)) WITHOUT ROWID",
)

values = st.one_of(
    st.none(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()),
    st.text(max_size=20).filter(lambda s: "\x00" not in s),
    st.binary(max_size=12),
)
r_keys = st.integers(min_value=1, max_value=30)
w_keys = st.tuples(st.sampled_from(["a", "b", "A", "é", ""]), st.integers(0, 3))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("r-put"), r_keys, values, values),
        st.tuples(st.just("r-del"), r_keys),
        st.tuples(st.just("r-set-a"), r_keys, values),
        st.tuples(st.just("w-put"), w_keys, values),
        st.tuples(st.just("w-del"), w_keys),
        st.just(("vacuum",)),
    ),
    max_size=25,
)


def _apply(db: Path, steps: list[tuple[Any, ...]]) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        for step in steps:
            if step[0] == "r-put":
                conn.execute("INSERT OR REPLACE INTO r VALUES (?, ?, ?)", step[1:])
            elif step[0] == "r-del":
                conn.execute("DELETE FROM r WHERE id = ?", (step[1],))
            elif step[0] == "r-set-a":
                conn.execute("UPDATE r SET a = ? WHERE id = ?", (step[2], step[1]))
            elif step[0] == "w-put":
                conn.execute("INSERT OR REPLACE INTO w VALUES (?, ?, ?)", (*step[1], step[2]))
            elif step[0] == "w-del":
                conn.execute("DELETE FROM w WHERE k = ? AND n = ?", step[1])
            else:
                conn.execute("VACUUM")
    finally:
        conn.close()


def _shown(v: object) -> object:
    """A value as the diff renders it (blobs as hex, texts cut)."""
    if isinstance(v, bytes):
        return f"x'{v.hex()}'"
    return v


def _oracle(before: Path, after: Path, table: str) -> dict[str, Any]:
    """The session extension's changes turning before's ``table`` into after's."""
    conn = apsw.Connection(str(after))
    try:
        conn.execute("ATTACH ? AS b", (str(before),))
        session = apsw.Session(conn, "main")
        session.attach(table)
        session.diff("b", table)
        changeset = session.changeset()
        session.close()
        columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
        pk = [
            row[1]
            for row in sorted(conn.execute(f"PRAGMA table_info({table})"), key=lambda r: r[5])
            if row[5]
        ]
    finally:
        conn.close()
    out: dict[str, Any] = {"inserted": set(), "deleted": set(), "updated": {}}
    for change in apsw.Changeset.iter(changeset):
        row = change.new if change.op == "INSERT" else change.old
        assert row is not None
        key = tuple(_shown(row[columns.index(k)]) for k in pk)
        if change.op == "INSERT":
            out["inserted"].add(key)
        elif change.op == "DELETE":
            out["deleted"].add(key)
        else:
            out["updated"][key] = {
                c: (_shown(o), _shown(n))
                for c, o, n in zip(columns, change.old or (), change.new or (), strict=True)
                if n is not apsw.no_change and c not in pk
            }
    return out


def _ours(d: DbDiff, table: str) -> dict[str, Any]:
    out: dict[str, Any] = {"inserted": set(), "deleted": set(), "updated": {}}
    t = next((t for t in d.tables if t.name == table), None)
    if t is None:
        return out
    assert not t.truncated and t.error is None
    assert (t.inserted, t.deleted, t.updated) == (
        sum(r.kind == "inserted" for r in t.rows),
        sum(r.kind == "deleted" for r in t.rows),
        sum(r.kind == "updated" for r in t.rows),
    )
    for r in t.rows:
        key = tuple(r.key[k] for k in t.key_columns)
        if r.kind == "updated":
            out["updated"][key] = dict(r.changes or {})
        else:
            out[r.kind].add(key)
    return out


@settings(
    max_examples=60,
    deadline=None,
    database=None,  # no example database in the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(seed=ops, change=ops)
@example(seed=[("r-put", 1, None, None)], change=[("r-put", 1, None, b"")])  # an empty blob
def test_the_diff_agrees_with_the_session_extension(
    tmp_path_factory: Any, seed: list[tuple[Any, ...]], change: list[tuple[Any, ...]]
) -> None:
    tmp = tmp_path_factory.mktemp("oracle")
    before, after = _pair(tmp, *SCHEMA)
    _apply(before, seed)
    shutil.copyfile(before, after)
    _apply(after, change)
    d = diff_databases(before, after, max_rows_per_table=10_000)
    assert d.error is None, d.error
    for table in ("r", "w"):
        assert _ours(d, table) == _oracle(before, after, table), table
