"""Row-level diff of a test run's DB copy against its baseline, safe against a hostile copy.

Guarantees: neither input is opened by SQLite or written (each is read with ``O_NOFOLLOW`` into
a private temp dir with its ``-wal``/``-journal``, then ATTACHed read-only), counts are exact,
and every problem (corrupt, not a DB, too large, too slow, evil names) becomes an ``error``
field, never an exception. Not guaranteed: values compare with SQLite's ``IS`` (``1`` equals
``1.0``), rows with a NULL non-integer primary key may pair arbitrarily, virtual tables are not
diffed, and listed values are rendered (text cut at 200 characters, blobs as a hex prefix).
"""

from __future__ import annotations

import errno
import math
import os
import sqlite3
import stat
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Final, Literal
from urllib.parse import quote

from pydantic import BaseModel

from sandbox.contracts.reports import DbDiff, JsonValue, RowChange, TableDiff
from sandbox.hostfs.fdcopy import copy_fd
from sandbox.hostfs.fdtree import remove_tree

__all__ = ["diff_databases"]

TEXT_LIMIT: Final = 200
BLOB_LIMIT: Final = 32
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


# --- SQL helpers ------------------------------------------------------------------------------


def _q(name: str) -> str:
    """Quote an SQL identifier (any text, quotes included)."""
    return '"' + name.replace('"', '""') + '"'


def _render_sql(expr: str) -> str:
    """SQL that yields a bounded value: text cut after TEXT_LIMIT+1 chars, blobs BLOB_LIMIT+1
    (an empty blob stays one: substr() of it is NULL)."""
    return (
        f"CASE typeof({expr}) WHEN 'text' THEN substr({expr}, 1, {TEXT_LIMIT + 1})"
        f" WHEN 'blob' THEN CASE length({expr}) WHEN 0 THEN x'' ELSE"
        f" substr({expr}, 1, {BLOB_LIMIT + 1}) END ELSE {expr} END"
    )


def _render(v: object) -> JsonValue:
    if v is None or isinstance(v, int | str):
        if isinstance(v, str) and len(v) > TEXT_LIMIT:
            return v[:TEXT_LIMIT] + "…"
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, bytes):
        more = "…" if len(v) > BLOB_LIMIT else ""
        return f"x'{v[:BLOB_LIMIT].hex()}'{more}"
    return repr(v)


class _Table(BaseModel):
    name: str
    sql: str | None
    columns: list[str]
    pk: list[str]
    virtual: bool


def _tables(conn: sqlite3.Connection, schema: str) -> dict[str, _Table]:
    """Every table the schema lists, SQLite's own and hidden ones included."""
    out: dict[str, _Table] = {}
    rows = conn.execute(
        f"SELECT name, sql FROM {schema}.sqlite_master WHERE type = 'table' ORDER BY name"
    ).fetchall()
    for name, sql in rows:
        if not isinstance(name, str) or name in out:
            continue
        virtual = isinstance(sql, str) and sql.lstrip()[:21].upper().startswith("CREATE VIRTUAL")
        cols: list[str] = []
        pk: list[tuple[int, str]] = []
        if not virtual:
            info = conn.execute(
                "SELECT name, pk FROM pragma_table_info(?, ?) ORDER BY cid", (name, schema)
            ).fetchall()
            cols = [str(c) for c, _ in info]
            pk = sorted((int(p), str(c)) for c, p in info if p)
        out[name] = _Table(
            name=name,
            sql=sql if isinstance(sql, str) else None,
            columns=cols,
            pk=[c for _, c in pk],
            virtual=virtual,
        )
    return out


def _schema_objects(conn: sqlite3.Connection, schema: str) -> list[tuple[str, str, str, str]]:
    """(type, name, tbl_name, sql) of every schema row (rootpage aside: VACUUM moves it)."""
    rows = conn.execute(
        f"SELECT quote(type), quote(name), quote(tbl_name), quote(sql) FROM {schema}.sqlite_master"
    ).fetchall()
    return sorted((str(t), str(n), str(tn), str(q)) for t, n, tn, q in rows)


def _canon(expr: str) -> str:
    """SQL giving one text that is equal for two values exactly when SQLite stores them the
    same: the storage class and the bytes (text by its bytes, never by a collation; a real
    by its round-trip rendering)."""
    return (
        f"CASE typeof({expr}) WHEN 'integer' THEN 'i' || {expr}"
        f" WHEN 'real' THEN 'r' || quote({expr}) WHEN 'text' THEN 't' || hex({expr})"
        f" WHEN 'blob' THEN 'b' || hex({expr}) ELSE 'n' END"
    )


def _canon_row(alias: str, columns: list[str]) -> str:
    return " || ',' || ".join(_canon(f"{alias}.{_q(c)}") for c in columns) or "''"


class _Differ:
    """One table's rows, before (``b``) and after (``a``), identified by primary key (its
    values as stored), else by their whole content (a multiset: VACUUM and reused rowids
    cannot mislabel a row). Each side is first indexed in a temp table of (key, row)."""

    def __init__(self, conn: sqlite3.Connection, max_rows: int) -> None:
        self.conn = conn
        self.max_rows = max_rows

    def _count(self, sql: str) -> int:
        row = self.conn.execute(sql).fetchone()
        return int(row[0] or 0)

    def _index(
        self, side: str, schema: str, t: _Table, columns: list[str], keys: list[str]
    ) -> None:
        """temp.<side>(k, r, nk): canonical key, canonical row, key has a NULL."""
        self.conn.execute(f"DROP TABLE IF EXISTS temp.{side}")
        key = _canon_row("s", keys) if keys else "NULL"
        nulls = " OR ".join(f"s.{_q(c)} IS NULL" for c in keys) or "1"
        self.conn.execute(
            f"CREATE TEMP TABLE {side} AS SELECT {key} AS k, {_canon_row('s', columns)} AS r,"
            f" ({nulls}) AS nk FROM {schema}.{_q(t.name)} AS s"
        )
        self.conn.execute(f"CREATE INDEX temp.{side}_k ON {side} (k)")
        self.conn.execute(f"CREATE INDEX temp.{side}_r ON {side} (r)")

    def _rows(
        self, schema: str, t: _Table, columns: list[str], what: str, match: str, limit: int
    ) -> list[dict[str, JsonValue]]:
        """Rows of ``schema.t`` whose canonical ``what`` (k or r) is in ``match``, rendered."""
        keys = t.pk if what == "k" else columns
        canon = _canon_row("s", keys) if keys else "NULL"
        sel = ", ".join(_render_sql(f"s.{_q(c)}") for c in columns)
        order = ", ".join(f"s.{_q(c)}" for c in keys) or "1"
        rows = self.conn.execute(
            f"SELECT {sel} FROM {schema}.{_q(t.name)} AS s WHERE {canon} IN ({match})"
            f" ORDER BY {order} LIMIT ?",
            (limit,),
        ).fetchall()
        return [{c: _render(v) for c, v in zip(columns, r, strict=True)} for r in rows]

    def one_sided(self, t: _Table, schema: str, status: Literal["added", "dropped"]) -> TableDiff:
        """Every row of a table that exists on one side only."""
        kind: Literal["inserted", "deleted"] = "inserted" if status == "added" else "deleted"
        d = TableDiff(name=t.name, status=status, key_columns=list(t.pk))
        if t.virtual:
            d.error = "virtual table: rows not compared"
            return d
        src = f"{schema}.{_q(t.name)}"
        count = self._count(f"SELECT count(*) FROM {src}")
        setattr(d, kind, count)
        sel = ", ".join(_render_sql(f"s.{_q(c)}") for c in t.columns)
        order = ", ".join(f"s.{_q(c)}" for c in (t.pk or t.columns)) or "1"
        rows = self.conn.execute(
            f"SELECT {sel} FROM {src} AS s ORDER BY {order} LIMIT ?", (self.max_rows,)
        ).fetchall()
        for r in rows:
            row = {c: _render(v) for c, v in zip(t.columns, r, strict=True)}
            d.rows.append(RowChange(kind=kind, key={k: row[k] for k in t.pk}, row=row))
        d.truncated = count > len(d.rows)
        return d

    def both(self, b: _Table, a: _Table) -> TableDiff:
        """Rows inserted, updated and deleted between ``b.t`` (before) and ``a.t`` (after)."""
        d = TableDiff(name=a.name)
        if a.virtual or b.virtual:
            d.error = "virtual table: rows not compared"
            return d
        if a.pk != b.pk:
            d.error = f"primary key changed ({b.pk} -> {a.pk}); rows not compared"
            return d
        keys = list(a.pk)
        d.key_columns = keys
        bcols = set(b.columns)
        common = [c for c in a.columns if c in bcols]
        # A column added or dropped is a schema change; rows are compared on the others.
        self._index("_b", "b", b, common, keys)
        self._index("_a", "a", a, common, keys)
        keyed = "nk = 0" if keys else "0"
        # Keyed rows: by key. Rows without a key (no primary key, or a NULL in it): by
        # content, as a multiset.
        d.inserted = self._count(
            f"SELECT count(*) FROM _a WHERE {keyed} AND k NOT IN (SELECT k FROM _b WHERE {keyed})"
        )
        d.deleted = self._count(
            f"SELECT count(*) FROM _b WHERE {keyed} AND k NOT IN (SELECT k FROM _a WHERE {keyed})"
        )
        d.updated = (
            self._count(
                f"SELECT count(*) FROM _a JOIN _b ON _a.k = _b.k WHERE _a.{keyed} AND _b.{keyed}"
                " AND _a.r <> _b.r"
            )
            if keys
            else 0
        )
        unkeyed = "nk = 1" if keys else "1"
        surplus = (
            "SELECT x.r AS r, x.c - coalesce(y.c, 0) AS extra FROM"
            " (SELECT r, count(*) AS c FROM {this} WHERE {u} GROUP BY r) AS x LEFT JOIN"
            " (SELECT r, count(*) AS c FROM {that} WHERE {u} GROUP BY r) AS y ON x.r = y.r"
            " WHERE x.c > coalesce(y.c, 0)"
        )
        more_a = surplus.format(this="_a", that="_b", u=unkeyed)
        more_b = surplus.format(this="_b", that="_a", u=unkeyed)
        d.inserted += self._count(f"SELECT sum(extra) FROM ({more_a})")
        d.deleted += self._count(f"SELECT sum(extra) FROM ({more_b})")
        total = d.inserted + d.updated + d.deleted
        budget = self.max_rows
        if total == 0 or budget <= 0:
            d.truncated = total > 0
            return d

        def key_of(row: dict[str, JsonValue]) -> dict[str, JsonValue]:
            return {k: row[k] for k in keys}

        ins_k = f"SELECT k FROM _a WHERE {keyed} AND k NOT IN (SELECT k FROM _b WHERE {keyed})"
        for row in self._rows("a", a, common, "k", ins_k, budget) if keys else []:
            d.rows.append(RowChange(kind="inserted", key=key_of(row), row=row))
        for row in self._rows("a", a, common, "r", f"SELECT r FROM ({more_a})", budget):
            if len(d.rows) < budget:
                d.rows.append(RowChange(kind="inserted", key=key_of(row) if keys else {}, row=row))
        if d.updated and len(d.rows) < budget:
            self._updates(d, a, b, common, keys, keyed, budget - len(d.rows))
        del_k = f"SELECT k FROM _b WHERE {keyed} AND k NOT IN (SELECT k FROM _a WHERE {keyed})"
        for row in self._rows("b", b, common, "k", del_k, budget) if keys else []:
            if len(d.rows) < budget:
                d.rows.append(RowChange(kind="deleted", key=key_of(row), row=row))
        for row in self._rows("b", b, common, "r", f"SELECT r FROM ({more_b})", budget):
            if len(d.rows) < budget:
                d.rows.append(RowChange(kind="deleted", key=key_of(row) if keys else {}, row=row))
        d.truncated = total > len(d.rows)
        return d

    def _updates(
        self,
        d: TableDiff,
        a: _Table,
        b: _Table,
        common: list[str],
        keys: list[str],
        keyed: str,
        limit: int,
    ) -> None:
        """The first updated rows by key, with each changed column's old and new value."""
        # Natural equality first (the primary key's index serves it), then as stored.
        on = " AND ".join(
            f"n.{_q(k)} = o.{_q(k)} AND {_canon(f'n.{_q(k)}')} = {_canon(f'o.{_q(k)}')}"
            for k in keys
        )
        sel = [_render_sql(f"n.{_q(k)}") for k in keys]
        for c in common:
            qc = _q(c)
            sel += [
                f"{_canon(f'n.{qc}')} <> {_canon(f'o.{qc}')}",
                _render_sql(f"o.{qc}"),
                _render_sql(f"n.{qc}"),
            ]
        changed = (
            f"SELECT _a.k FROM _a JOIN _b ON _a.k = _b.k WHERE _a.{keyed} AND _b.{keyed}"
            " AND _a.r <> _b.r"
        )
        kn = _canon_row("n", keys)
        order = ", ".join(f"n.{_q(k)}" for k in keys)
        rows = self.conn.execute(
            f"SELECT {', '.join(sel)} FROM a.{_q(a.name)} AS n JOIN b.{_q(b.name)} AS o ON {on}"
            f" WHERE {kn} IN ({changed}) ORDER BY {order} LIMIT ?",
            (limit,),
        ).fetchall()
        nk = len(keys)
        for r in rows:
            changes: dict[str, tuple[JsonValue, JsonValue]] = {}
            for i, c in enumerate(common):
                flag, old, new = r[nk + 3 * i : nk + 3 * i + 3]
                if flag and c not in keys:
                    changes[c] = (_render(old), _render(new))
            d.rows.append(
                RowChange(
                    kind="updated",
                    key={k: _render(v) for k, v in zip(keys, r[:nk], strict=True)},
                    changes=changes,
                )
            )


# --- private copies ---------------------------------------------------------------------------


class _InputError(Exception):
    pass


def _private_copy(path: Path, dest_dir: Path, label: str, max_bytes: int, notes: list[str]) -> Path:
    """Copy ``path`` (+ its -wal/-journal) into ``dest_dir`` without following any link."""
    dest = dest_dir / "db.sqlite"
    for suffix in ("", "-wal", "-journal"):
        src = str(path) + suffix
        try:
            fd = os.open(src, _OPEN_FLAGS)
        except FileNotFoundError:
            if not suffix:
                raise _InputError(f"{label} database {path} does not exist") from None
            continue
        except OSError as exc:
            what = "is a symlink (not followed)" if exc.errno == errno.ELOOP else exc.strerror
            if not suffix:
                raise _InputError(f"{label} database {path}: {what}") from None
            notes.append(f"{label}: ignored {src}: {what}")
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                if not suffix:
                    raise _InputError(f"{label} database {path} is not a regular file")
                notes.append(f"{label}: ignored {src}: not a regular file")
                continue
            if st.st_size > max_bytes:
                raise _InputError(
                    f"{label} database {src} is too large to diff ({st.st_size} bytes >"
                    f" {max_bytes})"
                )
            out = os.open(
                str(dest) + suffix,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            try:
                copy_fd(fd, out, limit=max_bytes)
            finally:
                os.close(out)
        finally:
            os.close(fd)
    return dest


def _journal_mode(path: Path) -> str:
    """The journal mode a database file says it is in: its header's format versions."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        header = os.pread(fd, 100, 0)
    finally:
        os.close(fd)
    return "wal" if len(header) >= 20 and header[18] == 2 and header[19] == 2 else "rollback"


def _settle(path: Path, label: str, check: bool, deadline: float) -> None:
    """Open a private copy read-write once: roll back a hot journal, fold in the WAL, check it."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        _harden(conn, deadline)
        mode = conn.execute("PRAGMA journal_mode = DELETE").fetchone()
        if not mode or str(mode[0]).lower() != "delete":
            raise _InputError(f"{label} database: cannot settle its journal ({mode})")
        if check:
            bad = [str(r[0]) for r in conn.execute("PRAGMA quick_check(5)").fetchall()]
            if bad != ["ok"]:
                detail = "; ".join(bad).replace("\n", "; ")
                raise _InputError(f"{label} database is corrupt: {detail}")
    finally:
        conn.close()


def _harden(conn: sqlite3.Connection, deadline: float) -> None:
    conn.text_factory = lambda b: b.decode("utf-8", "replace")
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    conn.execute("PRAGMA trusted_schema = OFF")
    conn.execute("PRAGMA cell_size_check = ON")
    conn.execute("PRAGMA mmap_size = 0")


def _uri(path: Path) -> str:
    return "file:" + quote(str(path)) + "?mode=ro"


# Why SQL in Python rather than the ``sqldiff`` tool: nothing needed on PATH, structured results
# (keys, old/new per column, exact counts with capped listings), and it runs under our own
# read-only, time-limited, schema-distrusting connection settings. Each table is diffed with
# NOT EXISTS / joins on the key (the primary key, else rowid) using IS, in one connection with
# both private copies ATTACHed.


def diff_databases(
    before: Path,
    after: Path,
    *,
    max_rows_per_table: int = 200,
    max_bytes: int = 4 * 1024**3,
    timeout_s: float = 120.0,
    work_dir: Path | None = None,
) -> DbDiff:
    """Diff ``after`` against ``before`` (see the module doc). Never raises for bad inputs.

    Call it after the step has stopped: it takes no SQLite locks on the inputs, and it must not
    run in a process holding SQLite connections to those same files (POSIX record locks are per
    process, and closing any fd on the file drops them).

    ``max_bytes`` refuses inputs larger than that (each file; holes are copied as holes);
    ``timeout_s`` bounds the work (a huge or pathological ``after`` becomes an error, not a
    hang). The private copies (and SQLite's temp files) live in a folder made in
    ``work_dir`` (the system's temp dir by default), removed before it returns.
    """
    result = DbDiff(before=str(before), after=str(after))
    deadline = time.monotonic() + timeout_s
    tmp = Path(tempfile.mkdtemp(prefix=".dbdiff-", dir=work_dir))
    try:
        (tmp / "b").mkdir()
        (tmp / "a").mkdir()
        pb = _private_copy(Path(before), tmp / "b", "before", max_bytes, result.notes)
        pa = _private_copy(Path(after), tmp / "a", "after", max_bytes, result.notes)
        journal = (_journal_mode(pb), _journal_mode(pa))
        _settle(pb, "before", check=False, deadline=deadline)
        _settle(pa, "after", check=True, deadline=deadline)
        conn = sqlite3.connect("file::memory:", uri=True, isolation_level=None)
        try:
            _harden(conn, deadline)
            conn.execute("ATTACH DATABASE ? AS b", (_uri(pb),))
            conn.execute("ATTACH DATABASE ? AS a", (_uri(pa),))
            # Both inputs are attached read-only (mode=ro); only temp tables are written.
            _diff(conn, result, max(0, max_rows_per_table))
            result.pragmas["journal_mode"] = journal[1]
            if journal[0] != journal[1]:
                result.pragmas_changed["journal_mode"] = journal
        finally:
            conn.close()
    except _InputError as exc:
        result.error = str(exc)
    except sqlite3.Error as exc:
        msg = str(exc)
        if msg == "interrupted":
            msg = f"interrupted: the diff took longer than {timeout_s:g}s"
        result.error = f"cannot diff databases: {msg}"
    except (OSError, ValueError, MemoryError, RecursionError) as exc:
        result.error = f"cannot diff databases: {type(exc).__name__}: {exc}"
    finally:
        remove_tree(tmp)  # fd-based: whatever SQLite or a planted name left in it
    if result.error:
        result.tables = []
    return result


def _guarded(
    make: Callable[[], TableDiff], name: str, status: Literal["changed", "added", "dropped"]
) -> TableDiff:
    """Run one table's diff; an SQLite error stays with that table (a timeout does not)."""
    try:
        return make()
    except sqlite3.Error as exc:
        if str(exc) == "interrupted":
            raise
        return TableDiff(name=name, status=status, error=str(exc))


def _diff(conn: sqlite3.Connection, result: DbDiff, max_rows: int) -> None:
    before = _tables(conn, "b")
    after = _tables(conn, "a")
    differ = _Differ(conn, max_rows)
    for name in sorted(after):
        a = after[name]
        b = before.get(name)
        if b is None:
            result.tables_added.append(name)
            result.tables.append(
                _guarded(partial(differ.one_sided, a, "a", "added"), name, "added")
            )
            continue
        result.tables_compared += 1
        if (a.sql or "") != (b.sql or ""):
            result.schema_changed.append(name)
        td = _guarded(partial(differ.both, b, a), name, "changed")
        if td.error or td.inserted or td.updated or td.deleted:
            result.tables.append(td)
    for name in sorted(set(before) - set(after)):
        b = before[name]
        result.tables_dropped.append(name)
        result.tables.append(
            _guarded(partial(differ.one_sided, b, "b", "dropped"), name, "dropped")
        )
    result.other_schema_changes = _schema_changes(conn, set(before) | set(after))
    result.pragmas = {name: _pragma(conn, "a", name) for name in _PRAGMAS}
    for name in _PRAGMAS:
        old, new = _pragma(conn, "b", name), result.pragmas[name]
        if old != new:
            result.pragmas_changed[name] = (old, new)


_PRAGMAS: Final = ("user_version", "application_id", "page_size", "auto_vacuum", "encoding")


def _pragma(conn: sqlite3.Connection, schema: str, name: str) -> JsonValue:
    row = conn.execute(f"PRAGMA {schema}.{name}").fetchone()
    return _render(row[0]) if row else None


def _schema_changes(conn: sqlite3.Connection, tables: set[str]) -> list[str]:
    """Every schema row added, dropped or changed that is not a table listed above (indexes,
    views, triggers, rows of an unknown type, hidden ones made through writable_schema)."""
    ob, oa = _schema_objects(conn, "b"), _schema_objects(conn, "a")
    by_b = {(t, n): sql for t, n, _tn, sql in ob}
    by_a = {(t, n): sql for t, n, _tn, sql in oa}
    out: list[str] = []
    for key in sorted(set(by_b) | set(by_a)):
        kind, name = (_unquote(key[0]), _unquote(key[1]))
        if kind == "table" and name in tables:
            continue
        if key not in by_b:
            out.append(f"{kind} added: {name}")
        elif key not in by_a:
            out.append(f"{kind} dropped: {name}")
        elif by_b[key] != by_a[key]:
            out.append(f"{kind} changed: {name}")
    if len(ob) != len(by_b) or len(oa) != len(by_a):
        out.append("schema has duplicate entries (written through writable_schema)")
    return out


def _unquote(quoted: str) -> str:
    if len(quoted) >= 2 and quoted[0] == quoted[-1] == "'":
        return quoted[1:-1].replace("''", "'")
    return quoted
