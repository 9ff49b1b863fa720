"""A test run as one self-contained HTML file people read (`sandbox report RUN --html FILE`).

A whole-workflow run's report has the workflow verdict (each step's results and
the chain's), the chain's stubbed actions, its steps, the timeline of the chain's
action log and the chain's DB diff, under the same rules.

In this order: the verdict (the verification's, else the run's status), what
changed against another run (`--against`, rendered from `sandbox.verify.compare`'s
comparison), the run's effects, every stubbed tool (grouped, with exact counts), the timeline of
guarded calls (decision, duration, session), the DB diff as tables, the files
changed, the egress lines, then preflight and resources. One file: the style is
inline, there is no script, no image, no link to anything, and a
Content-Security-Policy that forbids every fetch, so opening the report reaches
nothing. Everything that came from the run (tool
arguments, reasons, file names, DB values) is escaped as text.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandbox.contracts.record import StubbedAction, StubbedCut, TestRunRecord, write_json_atomic
from sandbox.contracts.reports import DbDiff
from sandbox.contracts.workflow_record import WorkflowRunRecord
from sandbox.verify.check import ExpectationResult
from sandbox.verify.compare import Comparison
from sandbox.verify.effects import effect_lines
from sandbox.verify.evidence import Call
from sandbox.verify.finished import FinishedChain, FinishedRun, FinishedStep
from sandbox.verify.verification import Verification, replay_lines
from sandbox.verify.workflow_verification import WorkflowVerification

MAX_TIMELINE = 2000
MAX_ARG_CHARS = 300

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em; color: #1d1d1f; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .4em 0; }
td, th { border: 1px solid #ccc; padding: .2em .5em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
code, .mono { font-family: ui-monospace, monospace; font-size: 12px; white-space: pre-wrap;
  word-break: break-all; }
.pass { color: #0a7a2f; font-weight: bold; } .fail { color: #b00020; font-weight: bold; }
.verdict { font-size: 1.3em; padding: .4em .8em; border: 2px solid; display: inline-block; }
"""

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src 'none'; form-action 'none'"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return text if len(text) <= MAX_ARG_CHARS else text[: MAX_ARG_CHARS - 3] + "..."


def _table(head: list[str], rows: list[list[str]]) -> str:
    """Cells are already escaped."""
    if not rows:
        return "<p>none</p>"
    out = ["<table><tr>", *(f"<th>{_e(h)}</th>" for h in head), "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _verdict(record: TestRunRecord, verification: Verification | None) -> str:
    if verification is None:
        ok = record.status.value == "passed"
        return (
            f'<p class="verdict {"pass" if ok else "fail"}">run {_e(record.status.value)}'
            " (no verification)</p>" + (f"<p>{_e(record.reason)}</p>" if record.reason else "")
        )
    ok = verification.passed
    held = sum(r.ok for r in verification.results)
    rows = [
        [
            f'<span class="{"pass" if r.ok else "fail"}">{"PASS" if r.ok else "FAIL"}</span>',
            _e(r.label),
            _e(r.expected),
            _e(r.happened),
            f'<span class="mono">{_e(chr(10).join(r.evidence))}</span>',
        ]
        for r in verification.results
    ]
    digest = "".join(f"<li>{_e(line)}</li>" for line in verification.digest.lines())
    return (
        f'<p class="verdict {"pass" if ok else "fail"}">{"PASS" if ok else "FAIL"}: '
        f"{held} of {len(verification.results)} expectation(s) held</p>"
        + _table(["", "expectation", "expected", "happened", "evidence"], rows)
        + f"<h3>digest</h3><ul>{digest}</ul>"
    )


def _duration(call: Call) -> str:
    ms = call.outcome.duration_ms if call.outcome is not None else call.line.duration_ms
    return f"{ms:.1f} ms" if ms is not None else ""


def _stubbed(
    groups: Sequence[StubbedAction],
    cut: StubbedCut,
    total: int,
    *,
    chain: bool = False,
    calls: Sequence[Call] = (),
) -> str:
    """The record's grouped list: every stubbed tool, its exact count and log lines
    (with a step's `calls`, each cited call's arguments as the log has them)."""
    by_line = {c.lineno: c for c in calls}

    def call(line: int, step: str, args: str, detail: str) -> str:
        where = f"line {line}" + (f" of {step}'s log" if chain and step else "") if line else ""
        logged = by_line.get(line) if line else None
        shown = _short(logged.line.arguments) if logged is not None else detail
        return f'<span class="mono">{_e(where)}\n{_e(args)}\n{_e(shown)}</span>'

    rows = []
    for g in groups:
        steps = getattr(g, "steps", {}) or {}
        first_step = getattr(g, "step_id", "")
        last_step = getattr(g, "last_step_id", "") or first_step
        row = [
            _e(g.tool + (f" {g.host}" if g.host else "")),
            _e(g.count),
            _e(g.reason),
            call(g.first_line, first_step, g.first_args, g.detail),
            call(g.last_line, last_step, g.last_args, g.last_detail or g.detail),
        ]
        if chain:
            row.insert(0, _e(", ".join(f"{k} x{n}" for k, n in steps.items()) or first_step))
        rows.append(row)
    head = ["tool", "calls", "why it was stubbed", "first call", "last call"]
    out = f"<p>{_e(total)} stubbed call(s), {_e(len(groups) + cut.groups)} distinct tool(s)</p>"
    out += _table((["steps"] if chain else []) + head, rows)
    if cut.groups:
        out += (
            f"<p>{_e(cut.groups)} more tool(s) with {_e(cut.calls)} call(s) were cut from "
            "this list (the action log has every line)</p>"
        )
    unlisted = total - sum(g.count for g in groups) - cut.calls
    if unlisted > 0:
        out += f"<p>{_e(unlisted)} more stubbed call(s) not listed (see the action log)</p>"
    return out


def _effects(record: TestRunRecord) -> str:
    return "<ul>" + "".join(f"<li>{_e(line)}</li>" for line in effect_lines(record)) + "</ul>"


def _timeline(calls: list[Call]) -> str:
    rows = [
        [
            _e(c.line.time.strftime("%H:%M:%S.%f")[:-3]),
            _e(c.line.session),
            _e(c.line.tool),
            _e(c.line.decision),
            _e(c.outcome.outcome if c.outcome is not None and c.outcome.outcome else ""),
            _e(_duration(c)),
            _e(c.line.reason),
        ]
        for c in calls[:MAX_TIMELINE]
    ]
    more = (
        f"<p>{len(calls) - MAX_TIMELINE} more call(s) not shown</p>"
        if len(calls) > MAX_TIMELINE
        else ""
    )
    return (
        _table(["time", "session", "tool", "decision", "outcome", "duration", "reason"], rows)
        + more
    )


def _db(diff: DbDiff | None, no_db: bool) -> str:
    if diff is None:
        return "<p>no workflow DB</p>" if no_db else "<p>no DB diff</p>"
    if diff.error:
        return f"<p>the DB diff failed: {_e(diff.error)}</p>"
    parts = [f"<p>{_e(line)}</p>" for line in diff.summary_lines()]
    for table in diff.tables:
        rows = []
        for row in table.rows:
            if row.kind == "updated":
                values = ", ".join(
                    f"{k}: {_short(old)} -> {_short(new)}"
                    for k, (old, new) in (row.changes or {}).items()
                )
            else:
                values = _short(row.row or {})
            rows.append(
                [_e(row.kind), _e(_short(row.key)), f'<span class="mono">{_e(values)}</span>']
            )
        cut = "<p>(rows capped)</p>" if table.truncated else ""
        parts.append(f"<h3>{_e(table.name)}</h3>" + _table(["change", "key", "values"], rows) + cut)
    return "".join(parts)


def _files(record: TestRunRecord) -> str:
    rows = [
        [_e(kind), _e(path)]
        for kind, paths in (
            ("created", record.files.created),
            ("changed", record.files.changed),
            ("deleted", record.files.deleted),
        )
        for path in paths
    ]
    cut = "<p>(lists capped)</p>" if record.files.truncated else ""
    return _table(["change", "path (group folder)"], rows) + cut


def _egress(calls: list[Call]) -> str:
    """Every request, DNS query and refused packet of the step, with how it reached the
    guard (`proxy`, or `direct`: redirected by the firewall); a query's answer, or a
    packet's count so far, stands in its status."""
    rows = []
    for c in calls:
        line = c.line
        if line.session != "egress" or line.tool not in ("http", "dns", "packet"):
            continue
        if line.tool == "packet":  # refused by the firewall; its count stands in its status
            args = line.arguments
            port = f":{args.get('port')}" if args.get("port") else ""
            what = f"{args.get('protocol', '')} {args.get('destination', '')}{port}"
            method, host = (str(args.get("protocol", "")).upper(), str(args.get("destination", "")))
            status = f"x{line.detail.get('count', 1)}"
        elif line.tool == "dns":
            what = f"{line.arguments.get('name', '')} {line.arguments.get('type', '')}"
            method, host, status = (
                "DNS",
                str(line.arguments.get("name", "")),
                line.detail.get("answer", ""),
            )
        else:
            what = str(line.arguments.get("url", ""))
            method, host = c.method, c.host
            status = (c.outcome.detail if c.outcome else line.detail).get("status", "")
        rows.append(
            [
                _e(method),
                f'<span class="mono">{_e(what)}</span>',
                _e(host),
                _e(line.detail.get("via", "proxy")),
                _e(line.decision),
                _e(status),
                _e(line.reason),
            ]
        )
    return _table(["method", "url or name", "host", "via", "decision", "status", "reason"], rows)


def _preflight(record: TestRunRecord) -> str:
    rows: list[list[str]] = []
    pre = record.preflight
    if pre is not None:
        rows.append(
            ["preflight", _e("every way out closed" if pre.ok else "OPEN: " + "; ".join(pre.open))]
        )
        rows.append(["preflight checks", _e(", ".join(pre.checks))])
        rows.append(["firewall read back", _e(pre.firewall_verified)])
    res = record.resources
    source = f" ({res.peak_memory_source})" if res.peak_memory_source else ""
    rows.append(["peak memory", _e(f"{res.peak_memory_bytes or 0} bytes{source}")])
    rows.append(["cpu", _e(f"{res.cpu_seconds} s")])
    rows.append(["disk used", _e(f"{record.disk_used_bytes} bytes")])
    rows.append(["duration", _e(f"{record.duration_s} s")])
    for name, secs in record.phases.model_dump().items():
        rows.append([_e(name), _e(f"{secs:.3f}")])
    if record.content is not None:
        rows.append(["content hash", f'<span class="mono">{_e(record.content.digest)}</span>'])
    return _table(["", ""], rows)


def _against(against: Comparison | None) -> list[tuple[str, str, str]]:
    """The section "What changed against RUN_B" (A: RUN_B, B: this run), from the
    comparison's own lines: the first divergence first, then every difference."""
    if against is None:
        return []
    body = against.differences()
    head = "".join(f"<p>{_e(line)}</p>" for line in against.lines()[:2])
    if not body:
        content = head + "<p>no difference</p>"
    else:
        items = "".join(f'<li><span class="mono">{_e(line)}</span></li>' for line in body)
        content = (
            head
            + f'<p><b>first divergence:</b> <span class="mono">{_e(body[0])}</span></p>'
            + f"<p>{len(body)} difference(s):</p><ol>{items}</ol>"
        )
    content += "".join(f"<p>{_e(line)}</p>" for line in against.notes())
    return [("against", f"What changed against {against.run_a}", content)]


def render(run: FinishedStep, against: Comparison | None = None) -> str:
    """One step's test run (an unreadable verification is shown as the run's status
    alone, never as a half-read verdict); with `against`, what changed against it."""
    ev, record, verification = run.evidence, run.record, run.verification
    sections = [
        ("verdict", "Verdict", _verdict(record, verification)),
        *_replayed(record),
        *_against(against),
        ("effects", "Effects", _effects(record)),
        (
            "stubbed",
            "Stubbed actions (would have run)",
            _stubbed(record.stubbed, record.stubbed_cut, record.actions.stub, calls=ev.calls),
        ),
        ("timeline", "Timeline of guarded calls", _timeline(ev.calls)),
        ("db", "DB diff", _db(record.db_diff, record.no_db)),
        ("files", "Files changed", _files(record)),
        ("egress", "Egress", _egress(ev.calls)),
        ("preflight", "Preflight and resources", _preflight(record)),
    ]
    body = "".join(
        f'<section id="{sid}"><h2>{_e(title)}</h2>{content}</section>'
        for sid, title, content in sections
    )
    title = f"test run {record.id}: {record.workflow_name} / {record.step_id}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="referrer" content="no-referrer">'
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{_e(title)}</h1><p>status {_e(record.status.value)}, exit code "
        f"{_e(record.exit_code)}, started {_e(record.started_at.isoformat())}</p>"
        f"{body}</body></html>\n"
    )


def _replayed(record: TestRunRecord) -> list[tuple[str, str, str]]:
    """A replayed run says so at the top: its reads came from a recording, not the world."""
    if record.replay is None:
        return []
    lines = "".join(f"<li>{_e(line)}</li>" for line in replay_lines(record.replay))
    return [("replay", "Replayed, not live", f'<ul class="fail">{lines}</ul>')]


def _results(results: list[ExpectationResult]) -> str:
    rows = [
        [
            f'<span class="{"pass" if r.ok else "fail"}">{"PASS" if r.ok else "FAIL"}</span>',
            _e(r.label),
            _e(r.expected),
            _e(r.happened),
            f'<span class="mono">{_e(chr(10).join(r.evidence))}</span>',
        ]
        for r in results
    ]
    return _table(["", "expectation", "expected", "happened", "evidence"], rows)


def _workflow_verdict(record: WorkflowRunRecord, verification: WorkflowVerification | None) -> str:
    if verification is None:
        ok = record.status.value == "passed"
        return (
            f'<p class="verdict {"pass" if ok else "fail"}">chain {_e(record.status.value)}'
            " (no verification)</p>" + (f"<p>{_e(record.reason)}</p>" if record.reason else "")
        )
    ok = verification.passed
    everything = [r for s in verification.steps for r in s.results] + verification.chain
    parts = [
        f'<p class="verdict {"pass" if ok else "fail"}">{"PASS" if ok else "FAIL"}: '
        f"{sum(r.ok for r in everything)} of {len(everything)} expectation(s) held "
        f"({_e(verification.expectations_file)})</p>"
    ]
    for step in verification.steps:
        if step.results:
            mark = "PASS" if step.passed else "FAIL"
            parts.append(
                f"<h3>step {step.index} {_e(step.step_id)}: {mark} ({_e(step.status)})</h3>"
                + _results(step.results)
            )
    parts.append("<h3>the chain</h3>" + _results(verification.chain))
    digest = "".join(f"<li>{_e(line)}</li>" for line in verification.digest.lines())
    return "".join(parts) + f"<h3>digest</h3><ul>{digest}</ul>"


def _chain_steps(record: WorkflowRunRecord) -> str:
    rows = [
        [
            _e(e.index),
            _e(e.step_id),
            _e(e.group),
            _e(e.status.value),
            _e(f"{e.duration_s:.1f} s" if e.duration_s is not None else ""),
            _e(f"{e.actions.allow} allowed, {e.actions.stub} stubbed, {e.actions.refuse} refused"),
            _e(e.reason),
            f'<span class="mono">{_e(e.record or "")}</span>',
        ]
        for e in record.steps
    ]
    return _table(
        ["", "step", "group", "status", "duration", "guarded calls", "reason", "record"], rows
    )


def _chain_stubbed(record: WorkflowRunRecord) -> str:
    total = sum(e.actions.stub for e in record.steps)
    return _stubbed(record.stubbed, record.stubbed_cut, total, chain=True)


def render_workflow(run: FinishedChain, against: Comparison | None = None) -> str:
    """A whole-workflow test run: its verdict (per step and for the chain), what changed
    against another run (with `against`), every stubbed action of the chain, its steps,
    the timeline, and the chain's DB diff."""
    record, verification, chain = run.record, run.verification, run.chain
    sections = [
        ("verdict", "Verdict", _workflow_verdict(record, verification)),
        *_against(against),
        ("stubbed", "Stubbed actions of the chain (would have run)", _chain_stubbed(record)),
        ("steps", "Steps", _chain_steps(record)),
        ("timeline", "Timeline of guarded calls (the chain's action log)", _timeline(chain.calls)),
        ("db", "DB diff (the real DB against the chain's copy)", _db(record.db_diff, False)),
        ("egress", "Egress", _egress(chain.calls)),
    ]
    body = "".join(
        f'<section id="{sid}"><h2>{_e(title)}</h2>{content}</section>'
        for sid, title, content in sections
    )
    title = f"workflow test run {record.id}: {record.workflow_name}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="referrer" content="no-referrer">'
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{_e(title)}</h1><p>status {_e(record.status.value)}, steps "
        f"{_e(' -> '.join(s.step_id for s in record.steps))}, started "
        f"{_e(record.started_at.isoformat())}</p>"
        f"{body}</body></html>\n"
    )


def write_report(run: FinishedRun, out: Path, against: Comparison | None = None) -> None:
    """The report of a test run: one step's, or a whole workflow's; with `against` (a
    comparison whose B is this run), what changed against its A."""
    text = render_workflow(run, against) if isinstance(run, FinishedChain) else render(run, against)
    write_json_atomic(out, text)
