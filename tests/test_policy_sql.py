"""Tests for sandbox.policy_sql: SQL classified by SQLite's own parser, reads proven read-only."""

from __future__ import annotations

import sqlite3

import pytest

from sandbox import policy_sql
from sandbox.policy import SqlKind, classify_sql

# --------------------------------------------------------------------------- classify_sql

R, W, M, F = SqlKind.READ, SqlKind.WRITE, SqlKind.MIGRATION, SqlKind.FORBIDDEN

SQL_CASES: list[tuple[str, SqlKind]] = [
    # reads
    ("SELECT 1", R),
    ("select * from proposals where job = 'x'", R),
    ("  \n\tSELECT 1;", R),
    ("VALUES (1), (2)", R),
    ("SELECT 'DROP TABLE proposals'", R),
    ("SELECT 'a''; DROP TABLE t; --' AS s", R),
    ('SELECT "drop", [attach], `delete` FROM t', R),
    ("SELECT x FROM t -- DROP TABLE t\n", R),
    ("SELECT /* ATTACH 'x' AS y */ 1", R),
    ("SELECT 1 -- ; DROP TABLE t", R),
    ("-- ATTACH 'x' AS y\nSELECT 1", R),
    ("SELECT 1 /* ; DROP TABLE t */", R),
    ("/* open comment runs to the end; DROP TABLE t", F),
    ("SELECT replace(name, 'a', 'b') FROM t", R),
    ("SELECT * FROM t WHERE a = :attach AND b = ?1 AND c = @drop AND d = $x", R),
    ("SELECT X'ABCD'", R),
    ("WITH a AS (SELECT 1) SELECT * FROM a", R),
    (
        "WITH RECURSIVE c(x) AS (VALUES(1) UNION ALL SELECT x+1 FROM c WHERE x < 5) SELECT x FROM c",
        R,
    ),
    ("EXPLAIN SELECT 1", R),
    ("EXPLAIN QUERY PLAN SELECT * FROM t", R),
    ("EXPLAIN DELETE FROM t", R),
    ("SELECT 1; SELECT 2;", R),
    ("PRAGMA table_info(proposals)", R),
    ("PRAGMA main.table_info('proposals')", R),
    ("pragma user_version", R),
    ("PRAGMA integrity_check", R),
    ("SELECT * FROM pragma_table_info('t')", R),
    # writes
    ("INSERT INTO t VALUES (1)", W),
    ("insert or replace into t values (1)", W),
    ("REPLACE INTO t VALUES (1)", W),
    ("UPDATE t SET a = 'CREATE TABLE'", W),
    ("DELETE FROM t WHERE a = 1", W),
    ("WITH a AS (SELECT 1) INSERT INTO t SELECT * FROM a", W),
    ("WITH a AS (SELECT id FROM t) UPDATE t SET x = 1 WHERE id IN a", W),
    ("WITH a AS (SELECT 1), b AS (SELECT 2) DELETE FROM t", W),
    ("INSERT INTO t VALUES (1) ON CONFLICT DO UPDATE SET a = 2 RETURNING *", W),
    ("BEGIN; INSERT INTO t VALUES (1); COMMIT", W),
    ("SELECT 1; DELETE FROM t", W),
    # migrations
    ("CREATE TABLE t (a)", M),
    ("create index i on t(a)", M),
    ("ALTER TABLE t RENAME TO u", M),
    ("DROP TABLE t", M),
    ("VACUUM", M),
    ("REINDEX", M),
    ("ANALYZE", M),
    ("CREATE TRIGGER tr AFTER INSERT ON t BEGIN UPDATE t SET a = 1; END;", M),
    ("SELECT 1; DROP TABLE t", M),
    ("INSERT INTO t VALUES (1); CREATE TABLE u (a)", M),
    ("/* harmless */ DROP TABLE t", M),
    # forbidden
    ("ATTACH DATABASE '/etc/x.db' AS x", F),
    ("attach 'x' as y", F),
    ("DETACH x", F),
    ("SELECT 1; ATTACH 'x' AS y", F),
    ("SELECT 1 /* hide */; ATTACH 'x' AS y", F),
    ("SELECT 1 -- comment\n; ATTACH 'x' AS y", F),
    ("/* comment */ ATTACH 'x' AS y", F),
    ("/**/ATTACH/**/'x'/**/AS y", F),
    ("SELECT load_extension('/tmp/evil.so')", F),
    ("SELECT LOAD_EXTENSION('x')", F),
    ("SELECT writefile('/tmp/x', 'y')", F),
    ("SELECT fts3_tokenizer('simple')", F),
    ("PRAGMA journal_mode = DELETE", F),
    ("PRAGMA journal_mode=OFF", F),
    ("PRAGMA writable_schema = ON", F),
    ("PRAGMA user_version = 7", F),
    ("PRAGMA schema_version(3)", F),
    ("PRAGMA optimize", F),
    ("PRAGMA wal_checkpoint(TRUNCATE)", F),
    ("PRAGMA not_a_pragma", F),
    ("EXPLAIN PRAGMA journal_mode = OFF", F),
    ("EXPLAIN ATTACH 'x' AS y", F),
    ("EXPLAIN", F),
    ("EXPLAIN QUERY PLAN", F),
    ("VACUUM INTO '/tmp/copy.db'", F),
    ("VACUUM main INTO 'x'", F),
    ("", F),
    ("   ", F),
    (";;", F),
    ("-- only a comment", F),
    ("SELECT 'unterminated", F),
    ('SELECT "unterminated', F),
    ("SELECT [unterminated", F),
    ("SELECT 1\x00; ATTACH 'x' AS y", F),
    ("(SELECT 1)", F),
    ("frobnicate the database", F),
    ("WITH a AS (SELECT 1)", F),
    ("WITH a AS (SELECT 1)) SELECT 1", F),
    ("SELECT 1; frobnicate", F),
]


@pytest.mark.parametrize(("sql", "kind"), SQL_CASES, ids=[repr(s)[:60] for s, _ in SQL_CASES])
def test_classify_sql(sql: str, kind: SqlKind) -> None:
    assert classify_sql(sql) is kind


def test_classify_sql_non_string_is_forbidden() -> None:
    assert classify_sql(None) is F  # type: ignore[arg-type]
    assert classify_sql(b"SELECT 1") is F  # type: ignore[arg-type]


def test_sql_kinds_order() -> None:
    assert [k.value for k in SqlKind] == ["read", "write", "migration", "forbidden"]


_READ_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
}


@pytest.mark.parametrize(
    "sql", [s for s, k in SQL_CASES if k is R], ids=[repr(s)[:60] for s, k in SQL_CASES if k is R]
)
def test_sql_classified_read_only_reads_in_real_sqlite(sql: str) -> None:
    """Cross-check with SQLite itself: running SQL classified READ changes nothing.

    The database image must be byte-identical afterwards, and SQLite's authorizer
    must see only read actions (and read-only PRAGMAs). Two documented
    exceptions in the authorizer check: EXPLAIN authorizes the statement it
    compiles without running it, and SQLite reports connecting an eponymous
    virtual table such as pragma_table_info as an UPDATE of sqlite_master.
    """
    con = sqlite3.connect(":memory:")
    try:
        con.execute(
            "CREATE TABLE t (id, a, b, c, d, x, name, job, claimed, [drop], [attach], [delete])"
        )
        con.execute("CREATE TABLE proposals (id, job, claimed)")
        con.execute("INSERT INTO t (id, name) VALUES (1, 'ab'), (2, 'cd')")
        con.execute("INSERT INTO proposals VALUES (1, 'j1', 0)")
        con.commit()
        before = con.serialize()
        actions: list[tuple[int, str | None]] = []

        def authorizer(
            action: int, arg1: str | None, arg2: str | None, db: str | None, trig: str | None
        ) -> int:
            actions.append((action, arg1))
            return sqlite3.SQLITE_OK

        con.set_authorizer(authorizer)
        con.executescript(sql)
        con.set_authorizer(None)
        assert con.serialize() == before
    finally:
        con.close()
    if sql.lstrip().upper().startswith("EXPLAIN"):
        return
    for action, arg1 in actions:
        if action == sqlite3.SQLITE_PRAGMA:
            assert arg1 is not None
            assert arg1.lower() in policy_sql._READ_PRAGMAS | policy_sql._READ_PRAGMAS_WITH_ARG
        elif action == sqlite3.SQLITE_UPDATE and arg1 == "sqlite_master":
            assert "pragma_" in sql.lower()
        else:
            assert action in _READ_ACTIONS, (sql, action, arg1)
