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
import shutil
import sqlite3
import stat
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Final, Literal
from urllib.parse import quote

from pydantic import BaseModel, Field

from sandbox.fdcopy import copy_fd

__all__ = ["DbDiff", "JsonValue", "RowChange", "TableDiff", "diff_databases"]

JsonValue = int | float | str | None

TEXT_LIMIT: Final = 200
BLOB_LIMIT: Final = 32
_SUMMARY_KEYS: Final = 5
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class RowChange(BaseModel):
    """One changed row. ``changes`` (column -> (old, new)) for updates; ``row`` otherwise."""

    kind: Literal["inserted", "updated", "deleted"]
    key: dict[str, JsonValue]
    changes: dict[str, tuple[JsonValue, JsonValue]] | None = None
    row: dict[str, JsonValue] | None = None


class TableDiff(BaseModel):
    """Changes in one table. Counts are exact; ``rows`` is capped (``truncated`` says so)."""

    name: str
    status: Literal["changed", "added", "dropped"] = "changed"
    key_columns: list[str] = Field(default_factory=list)
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    rows: list[RowChange] = Field(default_factory=list)
    truncated: bool = False
    error: str | None = None


class DbDiff(BaseModel):
    """The row-level difference ``after`` minus ``before``; ``error`` set if it failed."""

    before: str
    after: str
    tables: list[TableDiff] = Field(default_factory=list)
    tables_added: list[str] = Field(default_factory=list)
    tables_dropped: list[str] = Field(default_factory=list)
    schema_changed: list[str] = Field(default_factory=list)
    other_schema_changes: list[str] = Field(default_factory=list)
    tables_compared: int = 0
    notes: list[str] = Field(default_factory=list)
    error: str | None = None

    @property
    def changed(self) -> bool:
        return bool(
            self.tables
            or self.tables_added
            or self.tables_dropped
            or self.schema_changed
            or self.other_schema_changes
        )

    def summary_lines(self) -> list[str]:
        """Human lines, e.g. ``proposals: 1 inserted (id=42), 1 updated (id=7: status ...)``."""
        if self.error:
            return [f"database diff failed: {_clean(self.error)}"]
        lines: list[str] = []
        for t in self.tables:
            label = _clean(t.name)
            if t.status != "changed":
                label += f" (table {t.status})"
            if t.error:
                lines.append(f"{label}: {_clean(t.error)}")
                continue
            parts = [p for p in (_kind_part(t, k) for k in _KINDS) if p]
            if parts:
                lines.append(f"{label}: {', '.join(parts)}")
            elif t.status != "changed":
                lines.append(f"{label}: no rows")
        if self.schema_changed:
            lines.append("schema changed: " + ", ".join(_clean(n) for n in self.schema_changed))
        lines.extend(_clean(c) for c in self.other_schema_changes)
        return lines or ["no database changes"]


_KINDS: Final[tuple[Literal["inserted", "updated", "deleted"], ...]] = (
    "inserted",
    "updated",
    "deleted",
)


def _clean(text: str) -> str:
    """One printable line: control characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _fmt(v: JsonValue) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, str):
        return "'" + _clean(v).replace("'", "\\'") + "'"
    return str(v)


def _fmt_key(key: dict[str, JsonValue]) -> str:
    return " ".join(f"{_clean(k)}={_fmt(v)}" for k, v in key.items())


def _kind_part(t: TableDiff, kind: Literal["inserted", "updated", "deleted"]) -> str:
    count: int = getattr(t, kind)
    if not count:
        return ""
    rows = [r for r in t.rows if r.kind == kind][:_SUMMARY_KEYS]
    if kind == "updated":
        shown = [
            _fmt_key(r.key)
            + ": "
            + ", ".join(
                f"{_clean(c)} {_fmt(o)} -> {_fmt(n)}" for c, (o, n) in (r.changes or {}).items()
            )
            for r in rows
        ]
        sep = "; "
    else:
        shown = [_fmt_key(r.key) for r in rows]
        sep = ", "
    if count > len(shown):
        shown.append(f"+{count - len(shown)} more")
    return f"{count} {kind} ({sep.join(shown)})"


# --- SQL helpers ------------------------------------------------------------------------------


def _q(name: str) -> str:
    """Quote an SQL identifier (any text, quotes included)."""
    return '"' + name.replace('"', '""') + '"'


def _render_sql(expr: str) -> str:
    """SQL that yields a bounded value: text cut after TEXT_LIMIT+1 chars, blobs BLOB_LIMIT+1."""
    return (
        f"CASE typeof({expr}) WHEN 'text' THEN substr({expr}, 1, {TEXT_LIMIT + 1})"
        f" WHEN 'blob' THEN substr({expr}, 1, {BLOB_LIMIT + 1}) ELSE {expr} END"
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
    out: dict[str, _Table] = {}
    rows = conn.execute(
        f"SELECT name, sql FROM {schema}.sqlite_master WHERE type = 'table' ORDER BY name"
    ).fetchall()
    for name, sql in rows:
        if not isinstance(name, str) or name.lower().startswith("sqlite_"):
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


def _other_objects(conn: sqlite3.Connection, schema: str) -> dict[tuple[str, str], str | None]:
    rows = conn.execute(
        f"SELECT type, name, sql FROM {schema}.sqlite_master WHERE type IN ('index', 'view',"
        " 'trigger')"
    ).fetchall()
    return {(str(t), str(n)): (s if isinstance(s, str) else None) for t, n, s in rows}


def _rowid_alias(*tables: _Table) -> str | None:
    used = {c.lower() for t in tables for c in t.columns}
    for alias in ("rowid", "_rowid_", "oid"):
        if alias not in used:
            return alias
    return None


class _Differ:
    def __init__(self, conn: sqlite3.Connection, max_rows: int) -> None:
        self.conn = conn
        self.max_rows = max_rows

    def _count(self, sql: str) -> int:
        row = self.conn.execute(sql).fetchone()
        return int(row[0])

    def one_sided(self, t: _Table, schema: str, status: Literal["added", "dropped"]) -> TableDiff:
        """Every row of a table that exists on one side only."""
        kind: Literal["inserted", "deleted"] = "inserted" if status == "added" else "deleted"
        d = TableDiff(name=t.name, status=status)
        if t.virtual:
            d.error = "virtual table: rows not compared"
            return d
        keys, key_exprs = self._key(t, t)
        if keys is None:
            d.error = "no usable row key (columns shadow rowid, _rowid_ and oid)"
            return d
        d.key_columns = keys
        src = f"{schema}.{_q(t.name)}"
        count = self._count(f"SELECT count(*) FROM {src} AS n")
        setattr(d, kind, count)
        cols = [f"n.{_q(c)}" for c in t.columns]
        sel = ", ".join(_render_sql(e) for e in [*(f"n.{e}" for e in key_exprs), *cols])
        order = ", ".join(f"n.{e}" for e in key_exprs)
        rows = self.conn.execute(
            f"SELECT {sel} FROM {src} AS n ORDER BY {order} LIMIT ?", (self.max_rows,)
        ).fetchall()
        nk = len(keys)
        for r in rows:
            d.rows.append(
                RowChange(
                    kind=kind,
                    key={k: _render(v) for k, v in zip(keys, r[:nk], strict=True)},
                    row={c: _render(v) for c, v in zip(t.columns, r[nk:], strict=True)},
                )
            )
        d.truncated = count > len(d.rows)
        return d

    def _key(self, a: _Table, b: _Table) -> tuple[list[str] | None, list[str]]:
        """Key column names and their quoted SQL (PK, else a free rowid alias)."""
        if a.pk:
            return list(a.pk), [_q(c) for c in a.pk]
        alias = _rowid_alias(a, b)
        if alias is None:
            return None, []
        return [alias], [alias]

    def both(self, b: _Table, a: _Table) -> TableDiff:
        """Rows inserted, updated and deleted between ``b.t`` (before) and ``a.t`` (after)."""
        d = TableDiff(name=a.name)
        if a.virtual or b.virtual:
            d.error = "virtual table: rows not compared"
            return d
        if a.pk != b.pk:
            d.error = f"primary key changed ({b.pk} -> {a.pk}); rows not compared"
            return d
        keys, key_exprs = self._key(a, b)
        if keys is None:
            d.error = "no usable row key (columns shadow rowid, _rowid_ and oid)"
            return d
        d.key_columns = keys
        ta, tb = f"a.{_q(a.name)}", f"b.{_q(b.name)}"
        join = " AND ".join(f"n.{e} IS o.{e}" for e in key_exprs)
        bcols = set(b.columns)
        common = [c for c in a.columns if c in bcols and c not in set(a.pk)]
        ins_from = f"FROM {ta} AS n WHERE NOT EXISTS (SELECT 1 FROM {tb} AS o WHERE {join})"
        del_from = f"FROM {tb} AS o WHERE NOT EXISTS (SELECT 1 FROM {ta} AS n WHERE {join})"
        diff = " OR ".join(f"n.{_q(c)} IS NOT o.{_q(c)}" for c in common)
        upd_from = f"FROM {ta} AS n JOIN {tb} AS o ON {join} WHERE {diff}" if common else ""
        d.inserted = self._count(f"SELECT count(*) {ins_from}")
        d.deleted = self._count(f"SELECT count(*) {del_from}")
        d.updated = self._count(f"SELECT count(*) {upd_from}") if upd_from else 0
        total = d.inserted + d.updated + d.deleted
        if total == 0:
            return d
        nk = len(keys)
        budget = self.max_rows
        if d.inserted and budget > 0:
            sel = [f"n.{e}" for e in key_exprs] + [f"n.{_q(c)}" for c in a.columns]
            order = ", ".join(f"n.{e}" for e in key_exprs)
            rows = self.conn.execute(
                f"SELECT {', '.join(map(_render_sql, sel))} {ins_from} ORDER BY {order} LIMIT ?",
                (budget,),
            ).fetchall()
            for r in rows:
                d.rows.append(
                    RowChange(
                        kind="inserted",
                        key={k: _render(v) for k, v in zip(keys, r[:nk], strict=True)},
                        row={c: _render(v) for c, v in zip(a.columns, r[nk:], strict=True)},
                    )
                )
            budget -= len(rows)
        if d.updated and budget > 0:
            sel = [_render_sql(f"n.{e}") for e in key_exprs]
            for c in common:
                qc = _q(c)
                sel += [f"n.{qc} IS NOT o.{qc}", _render_sql(f"o.{qc}"), _render_sql(f"n.{qc}")]
            order = ", ".join(f"n.{e}" for e in key_exprs)
            rows = self.conn.execute(
                f"SELECT {', '.join(sel)} {upd_from} ORDER BY {order} LIMIT ?", (budget,)
            ).fetchall()
            for r in rows:
                changes: dict[str, tuple[JsonValue, JsonValue]] = {}
                for i, c in enumerate(common):
                    flag, old, new = r[nk + 3 * i : nk + 3 * i + 3]
                    if flag:
                        changes[c] = (_render(old), _render(new))
                d.rows.append(
                    RowChange(
                        kind="updated",
                        key={k: _render(v) for k, v in zip(keys, r[:nk], strict=True)},
                        changes=changes,
                    )
                )
            budget -= len(rows)
        if d.deleted and budget > 0:
            sel = [f"o.{e}" for e in key_exprs] + [f"o.{_q(c)}" for c in b.columns]
            order = ", ".join(f"o.{e}" for e in key_exprs)
            rows = self.conn.execute(
                f"SELECT {', '.join(map(_render_sql, sel))} {del_from} ORDER BY {order} LIMIT ?",
                (budget,),
            ).fetchall()
            for r in rows:
                d.rows.append(
                    RowChange(
                        kind="deleted",
                        key={k: _render(v) for k, v in zip(keys, r[:nk], strict=True)},
                        row={c: _render(v) for c, v in zip(b.columns, r[nk:], strict=True)},
                    )
                )
        d.truncated = total > len(d.rows)
        return d


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
) -> DbDiff:
    """Diff ``after`` against ``before`` (see the module doc). Never raises for bad inputs.

    Call it after the step has stopped: it takes no SQLite locks on the inputs, and it must not
    run in a process holding SQLite connections to those same files (POSIX record locks are per
    process, and closing any fd on the file drops them).

    ``max_bytes`` refuses inputs larger than that (each file); ``timeout_s`` bounds the work
    (a huge or pathological ``after`` becomes an error, not a hang).
    """
    result = DbDiff(before=str(before), after=str(after))
    deadline = time.monotonic() + timeout_s
    tmp = Path(tempfile.mkdtemp(prefix="sandbox-dbdiff-"))
    try:
        (tmp / "b").mkdir()
        (tmp / "a").mkdir()
        pb = _private_copy(Path(before), tmp / "b", "before", max_bytes, result.notes)
        pa = _private_copy(Path(after), tmp / "a", "after", max_bytes, result.notes)
        _settle(pb, "before", check=False, deadline=deadline)
        _settle(pa, "after", check=True, deadline=deadline)
        conn = sqlite3.connect("file::memory:", uri=True, isolation_level=None)
        try:
            _harden(conn, deadline)
            conn.execute("ATTACH DATABASE ? AS b", (_uri(pb),))
            conn.execute("ATTACH DATABASE ? AS a", (_uri(pa),))
            conn.execute("PRAGMA query_only = ON")
            _diff(conn, result, max(0, max_rows_per_table))
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
        shutil.rmtree(tmp, ignore_errors=True)
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
    ob, oa = _other_objects(conn, "b"), _other_objects(conn, "a")
    for key in sorted(set(ob) | set(oa)):
        kind, name = key
        if key not in ob:
            result.other_schema_changes.append(f"{kind} added: {name}")
        elif key not in oa:
            result.other_schema_changes.append(f"{kind} dropped: {name}")
        elif ob[key] != oa[key]:
            result.other_schema_changes.append(f"{kind} changed: {name}")
