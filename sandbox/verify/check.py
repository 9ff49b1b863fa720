"""Judging expectations against one run's evidence: pure, no Docker, no clock.

Every result says what was expected, what happened, and the evidence that decided
it: the action-log line (its number and text), the DB row, the file, or the
record's status. Fail closed: evidence that is incomplete where the answer
depends on it (a truncated log, a capped diff, a file that cannot be read) fails
the expectation and says why, never passes it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, JsonValue

from sandbox.contracts.reports import RowChange
from sandbox.verify.evidence import Call, Evidence, Facts, GroupFiles
from sandbox.verify.expect import (
    CallExpectation,
    DbExpectation,
    FileExpectation,
    InSteps,
    Match,
    Named,
    NoCallExpectation,
    NoOtherDbChanges,
    StatusExpectation,
    _CallShape,
)
from sandbox.verify.hostmatch import HostIndex
from sandbox.verify.match import first_mismatch, json_equal, matches, select, show


class ExpectationResult(BaseModel):
    """One line of the verdict."""

    label: str = Field(description="The expectation's name, or what it expects.")
    kind: str = Field(description="Its kind (`call`, `no_call`, `db`, `file`, `status`, ...).")
    ok: bool = Field(description="It held.")
    expected: str = Field(description="What was expected, in words.")
    happened: str = Field(description="What happened, in words.")
    evidence: list[str] = Field(
        default_factory=list,
        description=("The action-log lines, DB rows, files or record fields that decided it."),
    )

    def line(self) -> str:
        mark = "PASS" if self.ok else "FAIL"
        if self.label == self.expected:
            text = f"{mark} {self.expected}: {self.happened}"
        else:
            text = f"{mark} {self.label}: expected {self.expected}; {self.happened}"
        return text + (f" [{self.evidence[0]}]" if self.evidence else "")


def _calls_like(shape: _CallShape, calls: list[Call]) -> tuple[list[Call], list[Call]]:
    """(calls of this tool/host whose arguments match, calls of it whose do not); a
    chain's expectation that names `steps` counts only those steps' calls."""
    if isinstance(shape, InSteps) and shape.steps:
        calls = [c for c in calls if c.in_step in shape.steps]
    hosts = HostIndex(calls) if shape.host is not None else None
    same_tool = [
        c
        for c in calls
        if c.line.tool == shape.tool_name
        and (shape.method is None or _method_may_be(c, shape.method))
        and (hosts is None or shape.host is None or hosts.matches(shape.host, c))
    ]
    hit = [c for c in same_tool if all(matches(m, c.line.arguments) for m in shape.args)]
    return hit, [c for c in same_tool if c not in hit]


def _method_may_be(call: Call, method: str) -> bool:
    """The call's method, or any method for a tunnel relayed unopened (the requests
    inside it were not seen, so any of them may have been this method)."""
    seen = call.method.upper()
    if seen == method.upper():
        return True
    return seen == "CONNECT" and call.line.detail.get("tls") == "method not seen"


def _near_miss(shape: _CallShape, misses: list[Call]) -> str:
    if not misses:
        return ""
    found = first_mismatch(shape.args, misses[0].line.arguments)
    if found is None:
        return ""
    m, got = found
    return f"; nearest: line {misses[0].lineno} has {m.path or '$'} = {show(got)}"


def _log_caveat(ev: Facts) -> str:
    notes = []
    if ev.log_truncated:
        notes.append("the action log is past its cap, later calls unread")
    if ev.log_full:
        notes.append("the action log filled: later calls have no line")
    if ev.malformed_lines:
        notes.append(f"{ev.malformed_lines} action-log line(s) did not parse")
    return "; ".join(notes)


def check_call(e: CallExpectation, ev: Facts, first_of: dict[str, int]) -> ExpectationResult:
    hit, misses = _calls_like(e, ev.calls)
    others = [c for c in hit if e.decision != "any" and c.line.decision != e.decision]
    counted = [c for c in hit if c not in others]
    low, high = e.bounds()
    n = len(counted)
    ok = n >= low and (high is None or n <= high)
    happened = f"{n} matching call(s)"
    if others:
        happened += f" (and {len(others)} with another decision: {others[0].line.decision})"
    evidence = [c.cite() for c in counted[:3]] or [c.cite() for c in others[:1]]
    if not counted:
        happened += _near_miss(e, misses)
    caveat = _log_caveat(ev)
    if caveat and (not ok or high is not None):
        ok = False
        happened += f"; {caveat}"
    if ok and e.after is not None:
        anchor = first_of.get(e.after)
        if anchor is None:
            ok = False
            happened += f"; {e.after!r} matched no call, so the order cannot hold"
        else:
            early = [c for c in counted if c.lineno <= anchor]
            if early:
                ok = False
                happened += f"; line {early[0].lineno} comes before {e.after!r} (line {anchor})"
                evidence = [early[0].cite()]
    return ExpectationResult(
        label="",
        kind=e.kind,
        ok=ok,
        expected=e.describe(),
        happened=happened,
        evidence=evidence,
    )


def check_no_call(e: NoCallExpectation, ev: Facts) -> ExpectationResult:
    hit, _ = _calls_like(e, ev.calls)
    caveat = _log_caveat(ev)
    ok = not hit and not caveat
    if hit:
        happened = f"tried {len(hit)} time(s) (decision {hit[0].line.decision})"
    else:
        happened = "never tried" + (f", but {caveat}" if caveat else "")
    return ExpectationResult(
        label="",
        kind=e.kind,
        ok=ok,
        expected=e.describe(),
        happened=happened,
        evidence=[c.cite() for c in hit[:3]],
    )


def _row_values(change: RowChange) -> dict[str, JsonValue]:
    """What a `where` is matched on: the row (inserted, deleted), or key + new values."""
    if change.kind == "updated":
        values: dict[str, JsonValue] = dict(change.key)
        values.update({col: new for col, (_old, new) in (change.changes or {}).items()})
        return values
    return dict(change.row or change.key)


def _row_matches(where: dict[str, JsonValue | Match], values: dict[str, JsonValue]) -> bool:
    for col, want in where.items():
        if col not in values:
            return False
        if isinstance(want, Match):
            if not matches(want, values[col]):
                return False
        elif not json_equal(want, values[col]):
            return False
    return True


def _cite_row(table: str, change: RowChange) -> str:
    values = _row_values(change)
    shown = ", ".join(f"{k}={show(v, 60)}" for k, v in values.items())
    return f"db {table} {change.kind} row: {shown}"


def _db_rows(e: DbExpectation, ev: Facts) -> tuple[list[RowChange], str]:
    """The diff's rows this expectation matches, and why they cannot be trusted ("")."""
    diff = ev.db_diff
    if diff is None:
        return [], "the run had no DB diff" + (" (no workflow DB)" if ev.no_db else "")
    if diff.error:
        return [], f"the DB diff failed: {diff.error}"
    table = next((t for t in diff.tables if t.name == e.table), None)
    if table is None:
        return [], ""
    if table.error:
        return [], f"the diff of {e.table} failed: {table.error}"
    rows = [
        r
        for r in table.rows
        if (e.change == "any" or r.kind == e.change) and _row_matches(e.where, _row_values(r))
    ]
    return rows, ("the diff's row list is capped" if table.truncated else "")


def check_db(e: DbExpectation, ev: Facts) -> ExpectationResult:
    rows, caveat = _db_rows(e, ev)
    low, high = e.bounds()
    n = len(rows)
    ok = n >= low and (high is None or n <= high) and not caveat
    happened = f"{n} matching row(s)"
    if caveat:
        happened += f"; {caveat}"
    diff = ev.db_diff
    table = next((t for t in diff.tables if t.name == e.table), None) if diff else None
    evidence = [_cite_row(e.table, r) for r in rows[:3]]
    if table is None and not caveat:
        happened += f"; {e.table} did not change"
    elif table is not None and not rows:
        happened += (
            f"; {e.table}: {table.inserted} inserted, {table.updated} updated, "
            f"{table.deleted} deleted"
        )
        evidence = [_cite_row(e.table, r) for r in table.rows[:1]]
    return ExpectationResult(
        label="", kind=e.kind, ok=ok, expected=e.describe(), happened=happened, evidence=evidence
    )


def check_no_other_db(e: NoOtherDbChanges, ev: Facts, db: list[DbExpectation]) -> ExpectationResult:
    diff = ev.db_diff
    expected = e.describe()
    if diff is None:
        happened = "no DB diff (the run had no workflow DB)" if ev.no_db else "no DB diff"
        return ExpectationResult(
            label="", kind=e.kind, ok=ev.no_db, expected=expected, happened=happened
        )
    if diff.error:
        return ExpectationResult(
            label="",
            kind=e.kind,
            ok=False,
            expected=expected,
            happened=f"the DB diff failed: {diff.error}",
        )
    structural = [
        *(f"table added: {n}" for n in diff.tables_added),
        *(f"table dropped: {n}" for n in diff.tables_dropped),
        *(f"schema changed: {n}" for n in diff.schema_changed),
        *diff.other_schema_changes,
        *(f"pragma {k} changed" for k in diff.pragmas_changed),
    ]
    if structural:
        return ExpectationResult(
            label="",
            kind=e.kind,
            ok=False,
            expected=expected,
            happened=structural[0],
            evidence=[f"db: {structural[0]}"],
        )
    for table in diff.tables:
        if table.truncated or table.error:
            why = table.error or "its row list is capped"
            return ExpectationResult(
                label="",
                kind=e.kind,
                ok=False,
                expected=expected,
                happened=f"{table.name} cannot be checked row by row: {why}",
            )
        for row in table.rows:
            values = _row_values(row)
            if not any(
                d.table == table.name
                and (d.change == "any" or d.change == row.kind)
                and _row_matches(d.where, values)
                for d in db
            ):
                cite = _cite_row(table.name, row)
                return ExpectationResult(
                    label="",
                    kind=e.kind,
                    ok=False,
                    expected=expected,
                    happened=f"an unexpected change in {table.name}",
                    evidence=[cite],
                )
    total = sum(t.inserted + t.updated + t.deleted for t in diff.tables)
    return ExpectationResult(
        label="",
        kind=e.kind,
        ok=True,
        expected=expected,
        happened=f"every one of {total} changed row(s) is expected",
    )


def _file_state(path: str, ev: GroupFiles) -> Literal["created", "changed", "deleted", "untouched"]:
    files = ev.files
    if path in files.created:
        return "created"
    if path in files.changed:
        return "changed"
    if path in files.deleted:
        return "deleted"
    return "untouched"


def _content_value(data: bytes, m: Match) -> Any:
    text = data.decode("utf-8", "replace")
    if m.path is None and m.subset is None:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return None


def check_file(e: FileExpectation, ev: GroupFiles) -> ExpectationResult:
    state = _file_state(e.path, ev)
    wanted = {"written": ("created", "changed")}.get(e.change, (e.change,))
    ok = state in wanted
    happened = f"{e.path} {state}"
    cite = f"{ev.files_label}: {e.path} {state}"
    if ev.files.truncated and state == "untouched":
        ok = False
        happened += " as far as the record says (its file lists are capped)"
    if ok and e.content:
        data = ev.read_group_file(e.path)
        if data is None:
            ok = False
            happened += "; its content cannot be read (not a regular file, a link, or too big)"
        else:
            for m in e.content:
                value = _content_value(data, m)
                if value is None and (m.path is not None or m.subset is not None):
                    ok = False
                    happened += "; its content is not JSON"
                    break
                if not matches(m, value):
                    ok = False
                    got = show(value if m.path is None else _select(value, m), 80)
                    happened += f"; content fails {m.describe()} (found {got})"
                    break
    return ExpectationResult(
        label="", kind=e.kind, ok=ok, expected=e.describe(), happened=happened, evidence=[cite]
    )


def _select(value: Any, m: Match) -> Any:
    return select(value, m.path)


def check_status(e: StatusExpectation, ev: Facts) -> ExpectationResult:
    ok = ev.status.value == e.status and (e.exit_code is None or ev.exit_code == e.exit_code)
    if isinstance(ev, Evidence):
        happened = f"status {ev.status.value}, exit code {ev.exit_code}"
        cite = f"record: status {ev.status.value}, exit_code {ev.exit_code}"
    else:  # a whole chain: its status, no exit code
        happened = f"chain status {ev.status.value}"
        cite = f"workflow record: status {ev.status.value}"
    if ev.reason:
        happened += f" ({ev.reason})"
    return ExpectationResult(
        label="", kind=e.kind, ok=ok, expected=e.describe(), happened=happened, evidence=[cite]
    )


def _unjudged(kind: str, expected: str, why: str) -> ExpectationResult:
    return ExpectationResult(
        label="", kind=kind, ok=False, expected=expected, happened=f"not judged here: {why}"
    )


def check_all(named: list[Named], ev: Facts) -> list[ExpectationResult]:
    """One result per expectation, in the order they were written."""
    first_of: dict[str, int] = {}
    for n in named:
        e = n.expectation
        if isinstance(e, CallExpectation) and e.name:
            hit, _ = _calls_like(e, ev.calls)
            counted = [c for c in hit if e.decision == "any" or c.line.decision == e.decision]
            if counted:
                first_of[e.name] = counted[0].lineno
    db = [n.expectation for n in named if isinstance(n.expectation, DbExpectation)]
    results: list[ExpectationResult] = []
    for n in named:
        e = n.expectation
        if isinstance(e, CallExpectation):
            result = check_call(e, ev, first_of)
        elif isinstance(e, NoCallExpectation):
            result = check_no_call(e, ev)
        elif isinstance(e, DbExpectation):
            result = check_db(e, ev)
        elif isinstance(e, NoOtherDbChanges):
            result = check_no_other_db(e, ev, db)
        elif isinstance(e, FileExpectation):
            group = getattr(e, "group", None)
            folder = ev.files_for(group)
            result = (
                check_file(e, folder)
                if folder is not None
                else _unjudged(e.kind, e.describe(), f"no step of the chain ran in group {group}")
            )
        else:
            result = check_status(e, ev)
        results.append(result.model_copy(update={"label": n.label}))
    return results
