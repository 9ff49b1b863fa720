"""The DB tools: one statement on the run's DB copy (`$DB_PATH`), read-only or read-write."""

from __future__ import annotations

import math
import os
import sqlite3
import time
import urllib.parse
from typing import Any, Final

from .results import ToolError, params_arg, str_arg, tool_result
from .toolargs import (
    DB_BUSY_TIMEOUT_S,
    DB_STATEMENT_DEADLINE_S,
)

DB_ENV: Final = "DB_PATH"


DB_MAX_ROWS: Final = 1000


DB_TEXT_ROWS: Final = 20


DB_TEXT_CELL_CHARS: Final = 60


def _json_cell(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _text_cell(value: Any) -> str:
    text = "NULL" if value is None else str(value)
    text = text.replace("\n", "\\n")
    if len(text) > DB_TEXT_CELL_CHARS:
        text = text[: DB_TEXT_CELL_CHARS - 1] + "…"
    return text


def _text_table(columns: list[str], rows: list[list[Any]], truncated: bool) -> str:
    count = f"{len(rows)} row{'s' if len(rows) != 1 else ''}"
    if truncated:
        count += f" (capped at {DB_MAX_ROWS}; more rows exist)"
    if not columns:
        return count
    lines = [" | ".join(columns)]
    lines += [" | ".join(_text_cell(v) for v in row) for row in rows[:DB_TEXT_ROWS]]
    if len(rows) > DB_TEXT_ROWS:
        lines.append(f"... {len(rows) - DB_TEXT_ROWS} more rows in data")
    lines.append(count)
    return "\n".join(lines)


class DbTools:
    """`query_workflow_db` and `mutate_workflow_db` on `$DB_PATH` (read at call time)."""

    root: str

    def _connect(self, *, read_only: bool) -> sqlite3.Connection:
        db_path = os.environ.get(DB_ENV, "")
        if not db_path:
            raise ToolError("no DB in this test run")
        mode = "ro" if read_only else "rw"
        uri = f"file:{urllib.parse.quote(os.path.abspath(db_path))}?mode={mode}"
        try:
            conn = sqlite3.connect(uri, uri=True, timeout=DB_BUSY_TIMEOUT_S)
        except sqlite3.Error as exc:
            raise ToolError(f"cannot open the DB copy: {exc}") from None
        try:
            conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
            if read_only:
                conn.execute("PRAGMA query_only = ON")
            stop_at = time.monotonic() + DB_STATEMENT_DEADLINE_S
            conn.set_progress_handler(lambda: int(time.monotonic() > stop_at), 10_000)
        except BaseException:
            conn.close()
            raise
        return conn

    def _run_sql(self, args: dict[str, Any], *, read_only: bool) -> dict[str, Any]:
        sql = str_arg(args, "sql")
        params = params_arg(args)
        conn = self._connect(read_only=read_only)
        try:
            try:
                cursor = conn.execute(sql, params)
                columns = [d[0] for d in cursor.description or ()]
                fetched = cursor.fetchmany(DB_MAX_ROWS + 1) if columns else []
                if not read_only:
                    conn.commit()
            except (sqlite3.Error, ValueError, OverflowError) as exc:
                message = str(exc)
                if message == "interrupted":
                    message = f"statement interrupted after {DB_STATEMENT_DEADLINE_S:.0f} s"
                raise ToolError(f"statement failed: {message}") from None
            truncated = len(fetched) > DB_MAX_ROWS
            rows = [[_json_cell(v) for v in row] for row in fetched[:DB_MAX_ROWS]]
            if read_only:
                data: dict[str, Any] = {"columns": columns, "rows": rows, "truncated": truncated}
                return tool_result(_text_table(columns, rows, truncated), data)
            data = {"rowcount": cursor.rowcount, "lastrowid": cursor.lastrowid}
            text = f"ok: {cursor.rowcount} row(s) changed, last row id {cursor.lastrowid}"
            if columns:
                data.update(columns=columns, rows=rows, truncated=truncated)
                text += "\n" + _text_table(columns, rows, truncated)
            return tool_result(text, data)
        finally:
            conn.close()

    def query_workflow_db(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._run_sql(args, read_only=True)

    def mutate_workflow_db(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._run_sql(args, read_only=False)
