"""The seal rule: a record whose action log the runner did not sync and seal proves nothing.

A log that was only written may still be in the page cache alone when the record is
read, and a run whose runner did not reach its collect phase (killed, crashed) never
sealed what it holds. So verify, gate and report accept a record only with
`log_synced_at` set (for a whole-workflow run: the chain's log and every step that
ran), and say "not verified: the action log was not sealed" otherwise.
"""

from __future__ import annotations

from sandbox.contracts.record import TestRunRecord
from sandbox.contracts.workflow_record import AnyRecord, WorkflowRunRecord
from sandbox.verify.check import ExpectationResult

NOT_SEALED = "not verified: the action log was not sealed"


def unsealed(record: AnyRecord) -> str:
    """Why the record's log is not sealed ("" when it is)."""
    if record.log_synced_at is None:
        return NOT_SEALED
    if isinstance(record, WorkflowRunRecord):
        steps = [e.step_id for e in record.steps if e.run_id and e.log_synced_at is None]
        if steps:
            return f"{NOT_SEALED} (step {', '.join(steps)})"
    return ""


def seal_results(record: TestRunRecord | WorkflowRunRecord) -> list[ExpectationResult]:
    """A failing result when the log is not sealed; nothing when it is."""
    why = unsealed(record)
    if not why:
        return []
    return [
        ExpectationResult(
            label="action log sealed",
            kind="seal",
            ok=False,
            expected="the action log synced by the runner when it sealed the record",
            happened=why,
            evidence=["record: log_synced_at"],
        )
    ]
