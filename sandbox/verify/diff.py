"""`sandbox diff RUN_A RUN_B`: what a step did differently in two finished test runs.

Built on the one reader of a finished run (`sandbox.verify.finished`), so it reads
what every other output reads, under the same rules. Compared: the effect ledgers
(the stubbed, refused and redirected calls of each action log, in order) aligned call
by call (tool, the arguments that differ, the decision, the position in each ledger);
the DB diffs row by row; the group folder's file changes, by content where both runs
left the file; egress per host; status and exit code; and, when both runs were
verified, each expectation's result. A record whose log was not sealed proves
nothing, so it is refused here as in verify, gate and report. Whole-workflow runs
are compared step by step on these (`sandbox.verify.chaindiff`); `sandbox.verify.compare`
loads two run folders and picks the one or the other.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from sandbox.contracts.errors import ConfigError
from sandbox.contracts.record import EgressCounts, TestRunRecord
from sandbox.contracts.reports import DbDiff, RowChange
from sandbox.termsafe import clean
from sandbox.verify.check import ExpectationResult
from sandbox.verify.evidence import MAX_FILE_BYTES, Call, read_below
from sandbox.verify.finished import FinishedStep
from sandbox.verify.seal import unsealed

LEDGER_DECISIONS = ("stub", "refuse", "redirect")
MAX_LEDGER = 20_000  # calls per run aligned (alignment is quadratic in the worst case)
MAX_VALUE_CHARS = 200


class ArgumentChange(BaseModel):
    """One argument of an aligned call that differs (`only_in`: present in one run)."""

    path: str  # `connects`, `params[2]`, `options.retry`
    a: Any = None
    b: Any = None
    only_in: Literal["a", "b"] | None = None


class CallChange(BaseModel):
    """A ledger entry added in B, removed from A, or changed between them (positions are
    1-based in each run's ledger; lines are its action log's)."""

    change: Literal["added", "removed", "changed"]
    tool: str
    position_a: int | None = None
    position_b: int | None = None
    line_a: int | None = None
    line_b: int | None = None
    decision_a: str | None = None
    decision_b: str | None = None
    arguments: list[ArgumentChange] = Field(default_factory=list)


class RowDifference(BaseModel):
    """One DB row change present in one run only, or in both with other values."""

    table: str
    kind: str  # inserted, updated, deleted
    key: dict[str, Any]
    difference: Literal["only_a", "only_b", "values"]
    a: RowChange | None = None
    b: RowChange | None = None


class FileDifference(BaseModel):
    """A file of the group folder that one run changed differently from the other."""

    path: str
    a: str | None = None  # created, changed, deleted; None: untouched in that run
    b: str | None = None
    content: Literal["same", "differs", "unknown"] | None = None


class HostDifference(BaseModel):
    host: str
    a: EgressCounts = Field(default_factory=EgressCounts)
    b: EgressCounts = Field(default_factory=EgressCounts)


class FieldDifference(BaseModel):
    name: str
    a: Any = None
    b: Any = None


class ExpectationDifference(BaseModel):
    label: str
    a: bool | None = None  # None: not an expectation of that run's verification
    b: bool | None = None


class RunComparison(BaseModel):
    """Two finished runs of a step compared; empty lists mean no difference there."""

    kind: Literal["step"] = "step"
    run_a: str
    run_b: str
    step_a: str
    step_b: str
    content_a: str | None = None
    content_b: str | None = None
    fields: list[FieldDifference] = Field(default_factory=list)
    calls: list[CallChange] = Field(default_factory=list)
    ledger_cut: bool = False
    db: list[RowDifference] = Field(default_factory=list)
    db_summary: tuple[list[str], list[str]] | None = None  # when the summaries differ
    files: list[FileDifference] = Field(default_factory=list)
    files_cut: bool = False
    egress: list[HostDifference] = Field(default_factory=list)
    expectations: list[ExpectationDifference] = Field(default_factory=list)
    expectations_compared: bool = False

    @property
    def same(self) -> bool:
        return not (
            self.fields
            or self.calls
            or self.db
            or self.db_summary
            or self.files
            or self.egress
            or self.expectations
        )

    def differences(self) -> list[str]:
        """One line per difference, in the order the comparison lists them."""
        body = field_lines(self.fields)
        body += [_call_line(c) for c in self.calls]
        body += [row_line(r) for r in self.db]
        if self.db_summary is not None and not self.db:
            body.append(summary_line(self.db_summary))
        body += [_file_line(f) for f in self.files]
        body += [_host_line(h) for h in self.egress]
        body += expectation_lines(self.expectations)
        return body

    def notes(self) -> list[str]:
        """What was not compared, and why."""
        notes = []
        if self.ledger_cut:
            notes.append(f"note: only the first {MAX_LEDGER} ledger calls of a run are compared")
        if self.files_cut:
            notes.append("note: a run's file lists were capped; files beyond them not compared")
        if not self.expectations_compared:
            notes.append("note: expectations not compared (a run was not verified)")
        return notes

    def lines(self) -> list[str]:
        """For people, terminal-safe: the first divergence first, then each part."""
        head = [
            f"A: test run {self.run_a} of {self.step_a}" + _version(self.content_a),
            f"B: test run {self.run_b} of {self.step_b}" + _version(self.content_b),
        ]
        return summarized(head, self.differences(), self.notes())


def summarized(head: list[str], body: list[str], notes: list[str]) -> list[str]:
    """A comparison's text: its head, the first divergence, every difference, the notes
    (each line terminal-safe)."""
    if not body:
        summary = ["no difference"]
    else:
        summary = [f"first divergence: {body[0]}", f"{len(body)} difference(s):"]
        summary += [f"  {line}" for line in body]
    return [clean(line, keep_newlines=False) for line in head + summary + notes]


def summary_line(summaries: tuple[list[str], list[str]]) -> str:
    return (
        "db: " + "; ".join(summaries[0] or ["no changes"]) + " -> "
        "" + "; ".join(summaries[1] or ["no changes"])
    )


def expectation_lines(expectations: list[ExpectationDifference]) -> list[str]:
    return [f"expectation {e.label!r}: {_held(e.a)} -> {_held(e.b)}" for e in expectations]


def field_lines(fields: list[FieldDifference]) -> list[str]:
    return [f"{f.name}: {_show(f.a)} -> {_show(f.b)}" for f in fields]


def _version(digest: str | None) -> str:
    return f" (content {digest[:16]})" if digest else ""


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def _held(ok: bool | None) -> str:
    return "absent" if ok is None else ("held" if ok else "failed")


def _call_line(c: CallChange) -> str:
    if c.change == "added":
        return f"call added: {c.tool} ({c.decision_b}) at B #{c.position_b} (line {c.line_b})"
    if c.change == "removed":
        return f"call removed: {c.tool} ({c.decision_a}) at A #{c.position_a} (line {c.line_a})"
    what = []
    if c.decision_a != c.decision_b:
        what.append(f"decision {c.decision_a} -> {c.decision_b}")
    for arg in c.arguments:
        if arg.only_in == "a":
            what.append(f"{arg.path} {_show(arg.a)} removed")
        elif arg.only_in == "b":
            what.append(f"{arg.path} {_show(arg.b)} added")
        else:
            what.append(f"{arg.path} {_show(arg.a)} -> {_show(arg.b)}")
    return f"call changed: {c.tool} at A #{c.position_a} / B #{c.position_b}: " + "; ".join(what)


def row_line(r: RowDifference) -> str:
    where = f"db {r.table} {r.kind} {_show(r.key)}"
    if r.difference == "only_a":
        return f"{where}: only in A"
    if r.difference == "only_b":
        return f"{where}: only in B"
    a = r.a.changes or r.a.row if r.a is not None else None
    b = r.b.changes or r.b.row if r.b is not None else None
    return f"{where}: {_show(a)} -> {_show(b)}"


def _file_line(f: FileDifference) -> str:
    if f.a == f.b:
        return f"file {f.path}: {f.a} in both, content {f.content}"
    return f"file {f.path}: {f.a or 'untouched'} -> {f.b or 'untouched'}"


def _host_line(h: HostDifference) -> str:
    def counts(c: EgressCounts) -> str:
        return f"{c.passed} passed, {c.stubbed} stubbed, {c.refused} refused"

    return f"egress {h.host}: {counts(h.a)} -> {counts(h.b)}"


def _same_json(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def argument_changes(a: Any, b: Any, path: str = "") -> list[ArgumentChange]:
    """Where two calls' arguments differ, by path (dicts by key, equal-length lists by
    index, anything else as a whole value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[ArgumentChange] = []
        for key in sorted(set(a) | set(b), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in b:
                out.append(ArgumentChange(path=sub, a=a[key], only_in="a"))
            elif key not in a:
                out.append(ArgumentChange(path=sub, b=b[key], only_in="b"))
            else:
                out += argument_changes(a[key], b[key], sub)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            c
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for c in argument_changes(x, y, f"{path}[{i}]")
        ]
    return [] if _same_json(a, b) else [ArgumentChange(path=path or "(arguments)", a=a, b=b)]


def _name(call: Call) -> str:
    if call.line.tool == "http" and (call.method or call.host):
        return f"egress {call.method} {call.host}"
    return call.line.tool


def ledger(calls: list[Call]) -> list[Call]:
    """The run's effect ledger: its stubbed, refused and redirected calls, in order."""
    return [c for c in calls if c.line.decision in LEDGER_DECISIONS]


def compare_ledgers(a: list[Call], b: list[Call]) -> list[CallChange]:
    """The two ledgers aligned by call (tool, or egress method and host) in order."""
    names_a, names_b = [_name(c) for c in a], [_name(c) for c in b]
    matcher = difflib.SequenceMatcher(None, names_a, names_b, autojunk=False)
    out: list[CallChange] = []
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op == "equal":
            for i, j in zip(range(a0, a1), range(b0, b1), strict=True):
                ca, cb = a[i], b[j]
                args = argument_changes(ca.line.arguments, cb.line.arguments)
                if args or ca.line.decision != cb.line.decision:
                    out.append(_change("changed", names_a[i], i, ca, j, cb, args))
            continue
        out += [_change("removed", names_a[i], i, a[i], None, None) for i in range(a0, a1)]
        out += [_change("added", names_b[j], None, None, j, b[j]) for j in range(b0, b1)]
    return out


def _change(
    change: Literal["added", "removed", "changed"],
    tool: str,
    i: int | None,
    ca: Call | None,
    j: int | None,
    cb: Call | None,
    args: list[ArgumentChange] | None = None,
) -> CallChange:
    return CallChange(
        change=change,
        tool=tool,
        position_a=None if i is None else i + 1,
        position_b=None if j is None else j + 1,
        line_a=ca.lineno if ca else None,
        line_b=cb.lineno if cb else None,
        decision_a=ca.line.decision if ca else None,
        decision_b=cb.line.decision if cb else None,
        arguments=args or [],
    )


def _rows(diff: DbDiff | None) -> dict[tuple[str, str, str], RowChange]:
    if diff is None:
        return {}
    return {
        (t.name, r.kind, json.dumps(r.key, sort_keys=True, default=str)): r
        for t in diff.tables
        for r in t.rows
    }


def compare_db(a: DbDiff | None, b: DbDiff | None) -> list[RowDifference]:
    """The two DB diffs row by row: a row change in one run only, or with other values."""
    rows_a, rows_b = _rows(a), _rows(b)
    out: list[RowDifference] = []
    for key in list(rows_a) + [k for k in rows_b if k not in rows_a]:
        ra, rb = rows_a.get(key), rows_b.get(key)
        if rb is None:
            difference: Literal["only_a", "only_b", "values"] = "only_a"
        elif ra is None:
            difference = "only_b"
        elif _same_json(ra.model_dump(), rb.model_dump()):
            continue
        else:
            difference = "values"
        row = ra or rb
        assert row is not None
        out.append(
            RowDifference(table=key[0], kind=key[1], key=row.key, difference=difference, a=ra, b=rb)
        )
    return out


def compare_db_summaries(a: DbDiff | None, b: DbDiff | None) -> tuple[list[str], list[str]] | None:
    """The two DB diffs' summaries when they differ (a diff that failed has no rows to
    compare, yet says so in its summary)."""
    summary_a = a.summary_lines() if a is not None else []
    summary_b = b.summary_lines() if b is not None else []
    return None if summary_a == summary_b else (summary_a, summary_b)


def _file_kinds(record: TestRunRecord) -> dict[str, str]:
    files = record.files
    kinds = {p: "created" for p in files.created}
    kinds |= {p: "changed" for p in files.changed}
    return kinds | {p: "deleted" for p in files.deleted}


def _digest(run: FinishedStep, rel: str) -> str | None:
    data = read_below(run.run_root / run.record.group, rel, MAX_FILE_BYTES)
    return hashlib.sha256(data).hexdigest() if data is not None else None


def compare_files(a: FinishedStep, b: FinishedStep) -> list[FileDifference]:
    """File changes compared: the kind of change, and the content each run left (read
    from each run's copy of the group folder, without following links, capped)."""
    kinds_a, kinds_b = _file_kinds(a.record), _file_kinds(b.record)
    out: list[FileDifference] = []
    for path in sorted(set(kinds_a) | set(kinds_b)):
        ka, kb = kinds_a.get(path), kinds_b.get(path)
        if ka != kb:
            out.append(FileDifference(path=path, a=ka, b=kb))
            continue
        if ka == "deleted":
            continue
        da, db = _digest(a, path), _digest(b, path)
        if da is None or db is None:
            out.append(FileDifference(path=path, a=ka, b=kb, content="unknown"))
        elif da != db:
            out.append(FileDifference(path=path, a=ka, b=kb, content="differs"))
    return out


def compare_expectations(
    a: list[ExpectationResult], b: list[ExpectationResult]
) -> list[ExpectationDifference]:
    """Each expectation (by label) that held in one verdict and not in the other, or
    that only one of them has."""
    held_a = {r.label: r.ok for r in a}
    held_b = {r.label: r.ok for r in b}
    labels = list(held_a) + [k for k in held_b if k not in held_a]
    return [
        ExpectationDifference(label=k, a=held_a.get(k), b=held_b.get(k))
        for k in labels
        if held_a.get(k) != held_b.get(k)
    ]


def compare_runs(a: FinishedStep, b: FinishedStep) -> RunComparison:
    """Two finished runs of a step compared (both must have a sealed log)."""
    for label, run in (("A", a), ("B", b)):
        if why := unsealed(run.record):
            raise ConfigError(f"run {label} ({run.run_root}): {why}; not compared")
    ra, rb = a.record, b.record
    fields = [
        FieldDifference(name=name, a=va, b=vb)
        for name, va, vb in (
            ("status", ra.status.value, rb.status.value),
            ("exit code", ra.exit_code, rb.exit_code),
        )
        if va != vb
    ]
    ledger_a, ledger_b = ledger(a.calls), ledger(b.calls)
    hosts = list(ra.egress) + [h for h in rb.egress if h not in ra.egress]
    egress = [
        HostDifference(
            host=h, a=ra.egress.get(h, EgressCounts()), b=rb.egress.get(h, EgressCounts())
        )
        for h in hosts
        if ra.egress.get(h, EgressCounts()) != rb.egress.get(h, EgressCounts())
    ]
    expectations: list[ExpectationDifference] = []
    compared = a.verification is not None and b.verification is not None
    if a.verification is not None and b.verification is not None:
        expectations = compare_expectations(a.verification.results, b.verification.results)
    return RunComparison(
        run_a=ra.id,
        run_b=rb.id,
        step_a=ra.step_id,
        step_b=rb.step_id,
        content_a=ra.content.digest if ra.content else None,
        content_b=rb.content.digest if rb.content else None,
        fields=fields,
        calls=compare_ledgers(ledger_a[:MAX_LEDGER], ledger_b[:MAX_LEDGER]),
        ledger_cut=max(len(ledger_a), len(ledger_b)) > MAX_LEDGER,
        db=compare_db(ra.db_diff, rb.db_diff),
        db_summary=compare_db_summaries(ra.db_diff, rb.db_diff),
        files=compare_files(a, b),
        files_cut=ra.files.truncated or rb.files.truncated,
        egress=egress,
        expectations=expectations,
        expectations_compared=compared,
    )
