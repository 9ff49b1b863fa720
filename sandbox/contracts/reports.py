"""The reports the mechanisms fill in, as the record carries them.

The tree copy (`sandbox.prepare.copytree`) fills a `CopyReport`, the DB copy
(`sandbox.prepare.dbcopy`) a `DbCopyReport`, the DB diff (`sandbox.collect.dbdiff`)
a `DbDiff`; the record (`sandbox.contracts.record`) holds them. They live here, with
the record, so that reading a record needs none of the mechanisms. Every list is
capped (`MAX_LISTED` entries for the copies, the diff's own caps) and every count
is exact.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, Field

from sandbox.contracts.defaults import empty_list

# A copy report keeps the first MAX_LISTED entries of each list; its counts are exact.
MAX_LISTED: Final = 1000

JsonValue = int | float | str | None

_SUMMARY_KEYS: Final = 5


# --------------------------------------------------------------------------- tree copies


class SymlinkEntry(BaseModel):
    """A symlink copied as a link; ``target`` is its text, never resolved."""

    path: str = Field(description="The link's path, relative to the copy's source.")
    target: str = Field(description="Its text, never resolved.")


class LeftOut(BaseModel):
    """A regular file not copied, and why (``cap``: it would have exceeded the byte cap)."""

    path: str = Field(description="The file not copied.")
    size: int = Field(description="Its size in bytes.")
    reason: str = Field(description="Why (`cap`: it would have passed the byte cap).")


class CopyReport(BaseModel):
    """What :func:`copy_execution_tree` did. Paths are relative to ``source``, posix style."""

    source: str = Field(description="The folder copied.")
    dest: str = Field(description="Where it went.")
    source_missing: bool = Field(default=False, description="There was nothing to copy.")
    cap_bytes: int = Field(description="The byte cap.")
    files_copied: int = Field(default=0, description="Files copied.")
    dirs_created: int = Field(default=0, description="Folders made.")
    bytes_copied: int = Field(default=0, description="Bytes copied (holes not counted).")
    symlinks: list[SymlinkEntry] = Field(
        default_factory=empty_list, description="Links copied as links (the first entries)."
    )
    left_out: list[LeftOut] = Field(
        default_factory=empty_list, description="Files left out (the first entries)."
    )
    skipped_special: list[str] = Field(
        default_factory=empty_list,
        description=("Special files skipped: FIFOs, sockets, devices (the first entries)."),
    )
    errors: list[str] = Field(default_factory=empty_list, description="Errors (the first entries).")
    # The lists above keep the first MAX_LISTED entries; the counts are exact.
    symlinks_count: int = Field(default=0, description="Links copied, exactly.")
    left_out_count: int = Field(default=0, description="Files left out, exactly.")
    skipped_special_count: int = Field(default=0, description="Special files skipped, exactly.")
    errors_count: int = Field(default=0, description="Errors, exactly.")
    # True when the tree had more entries than the copy's entry cap (the rest not copied).
    entries_capped: bool = Field(
        default=False,
        description=("The tree had more entries than the copy's cap; the rest were not copied."),
    )

    def note_error(self, text: str) -> None:
        self.errors_count += 1
        if len(self.errors) < MAX_LISTED:
            self.errors.append(text[:1000])


# --------------------------------------------------------------------------- the DB copy


class DbCopyReport(BaseModel):
    """What :func:`copy_db` produced."""

    source: str = Field(description="The real DB.")
    dest: str = Field(description="The copy.")
    bytes: int = Field(description="The copy's size.")
    tables: int = Field(description="Tables in it.")
    method: Literal["vacuum_into"] = Field(default="vacuum_into", description="How it was made.")
    seconds: float = Field(description="How long it took.")


# --------------------------------------------------------------------------- the DB diff


class RowChange(BaseModel):
    """One changed row. ``changes`` (column -> (old, new)) for updates; ``row`` otherwise."""

    kind: Literal["inserted", "updated", "deleted"] = Field(description="What happened to the row.")
    key: dict[str, JsonValue] = Field(
        description=("The row's key (primary key as stored, or the full row without one).")
    )
    changes: dict[str, tuple[JsonValue, JsonValue]] | None = Field(
        default=None, description="For updates: column -> [old, new]."
    )
    row: dict[str, JsonValue] | None = Field(
        default=None, description="For inserts and deletes: the row."
    )


class TableDiff(BaseModel):
    """Changes in one table. Counts are exact; ``rows`` is capped (``truncated`` says so)."""

    name: str = Field(description="The table.")
    status: Literal["changed", "added", "dropped"] = Field(
        default="changed", description="Changed, added or dropped."
    )
    key_columns: list[str] = Field(
        default_factory=empty_list, description="The columns that identify a row."
    )
    inserted: int = Field(default=0, description="Rows inserted, exactly.")
    updated: int = Field(default=0, description="Rows updated, exactly.")
    deleted: int = Field(default=0, description="Rows deleted, exactly.")
    rows: list[RowChange] = Field(
        default_factory=empty_list, description="The changed rows (capped)."
    )
    truncated: bool = Field(default=False, description="`rows` was cut.")
    error: str | None = Field(default=None, description="Why the table could not be compared.")


class DbDiff(BaseModel):
    """The row-level difference ``after`` minus ``before``; ``error`` set if it failed."""

    before: str = Field(description="The DB compared from.")
    after: str = Field(description="The DB compared to.")
    tables: list[TableDiff] = Field(
        default_factory=empty_list, description="Tables whose rows changed."
    )
    tables_added: list[str] = Field(default_factory=empty_list, description="Tables created.")
    tables_dropped: list[str] = Field(default_factory=empty_list, description="Tables dropped.")
    schema_changed: list[str] = Field(
        default_factory=empty_list, description="Tables whose schema changed."
    )
    other_schema_changes: list[str] = Field(
        default_factory=empty_list,
        description=("Indexes, triggers, views and hidden schema rows that changed."),
    )
    tables_compared: int = Field(default=0, description="Tables compared.")
    # Database-wide settings after the run, and the ones the step changed (old, new).
    # journal_mode is read from the file's header: "wal" or "rollback".
    pragmas: dict[str, JsonValue] = Field(
        default_factory=dict, description="Database-wide settings after the run."
    )
    pragmas_changed: dict[str, tuple[JsonValue, JsonValue]] = Field(
        default_factory=dict, description="Settings the step changed: name -> [old, new]."
    )
    notes: list[str] = Field(default_factory=empty_list, description="Remarks on the comparison.")
    error: str | None = Field(default=None, description="Why the diff failed.")

    @property
    def changed(self) -> bool:
        return bool(
            self.tables
            or self.tables_added
            or self.tables_dropped
            or self.schema_changed
            or self.other_schema_changes
            or self.pragmas_changed
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
        lines.extend(
            f"pragma {name}: {_fmt(old)} -> {_fmt(new)}"
            for name, (old, new) in sorted(self.pragmas_changed.items())
        )
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
        # A table without a primary key names its rows by their content.
        shown = [_fmt_key(r.key or r.row or {}) for r in rows]
        sep = ", "
    if count > len(shown):
        shown.append(f"+{count - len(shown)} more")
    return f"{count} {kind} ({sep.join(shown)})"
