"""What counts as an effect of a test run: the one definition the gate and the reports use.

The spec's effects table decides what a call may do; a run *showed an effect* when
anything it did would have reached past the test run, or when its record cannot
say it did not:
- a stubbed call (it would have run), a refused call, a denied egress request;
- a write into the DB copy: a DB diff that is not empty (or that failed, or is
  missing where the step had a DB), a redirected call whose SQL is not a read;
- an action log that is not whole: full, cut at its size cap, lines that do not
  parse, calls started with no outcome (the guard stopped mid-call).
What the step wrote in its own group folder is its output, not an effect: the
next real run reads it, it reaches nobody else. Only the record is read (the
counts the host took from the log when the run ended).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sandbox.contracts.record import RunStatus, TestRunRecord

EffectKind = Literal[
    "stubbed", "refused", "denied_egress", "db_write", "redirected_write", "incomplete_log"
]


@dataclass(frozen=True)
class Effect:
    kind: EffectKind
    text: str


def effects_of(record: TestRunRecord) -> list[Effect]:
    """Every effect the run's record shows, most telling first (empty: none)."""
    counts = record.actions
    out: list[Effect] = []
    if counts.stub or counts.stubbed_unlogged:
        tools = [a.tool for a in record.stubbed[:3]]
        more = len(record.stubbed) + record.stubbed_cut.groups - len(tools)
        named = ", ".join(tools) + (f", +{more} more tool(s)" if more > 0 else "")
        total = counts.stub + (counts.stubbed_unlogged or 0)
        out.append(Effect("stubbed", f"{total} stubbed call(s)" + (f" ({named})" if named else "")))
    if counts.refuse:
        out.append(Effect("refused", f"{counts.refuse} refused call(s)"))
    denied = sorted(h or "?" for h, n in record.egress.items() if n.stubbed or n.refused)
    if denied:
        out.append(Effect("denied_egress", "denied egress to " + ", ".join(denied[:3])))
    diff = record.db_diff
    if diff is not None and diff.error:
        out.append(Effect("db_write", "the DB diff failed, so a DB write cannot be ruled out"))
    elif diff is not None and diff.changed:
        out.append(Effect("db_write", "DB write(s): " + "; ".join(diff.summary_lines()[:3])))
    elif diff is None and not record.no_db and record.db_copy is not None:
        out.append(Effect("db_write", "no DB diff, so a DB write cannot be ruled out"))
    # A record from before `redirect_write` was counted: every redirect may have written.
    writes = counts.redirect if counts.redirect_write is None else counts.redirect_write
    if writes:
        out.append(Effect("redirected_write", f"{writes} redirected DB write(s) into the copy"))
    incomplete = [
        what
        for what, shown in (
            ("it reached its cap (log_full)", counts.log_full),
            ("it was cut at its size cap", counts.truncated),
            (f"{counts.malformed} line(s) did not parse", counts.malformed),
            (f"{counts.outcome_unknown} call(s) with no outcome", counts.outcome_unknown),
        )
        if shown
    ]
    if incomplete:
        what = "its action log is incomplete: " + "; ".join(incomplete)
        out.append(Effect("incomplete_log", what))
    return out


def why_not_effect_free(record: TestRunRecord) -> str:
    """Why the run cannot vouch that its step has no effect ("": it can): its first
    effect, or that it did not pass (a run that stopped early shows nothing)."""
    shown = effects_of(record)
    if shown:
        return "; ".join(e.text for e in shown)
    if record.status is not RunStatus.PASSED:
        return f"it did not pass ({record.status.value})"
    return ""


def effect_lines(record: TestRunRecord) -> list[str]:
    """The effects as `sandbox show` and the report list them."""
    shown = effects_of(record)
    if not shown:
        return ["effects: none (no stubbed, refused or denied call, no DB write, a whole log)"]
    return ["effects (what `gate --allow-no-effects` refuses):"] + [f"  - {e.text}" for e in shown]
