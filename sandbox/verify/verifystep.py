"""`verify_step`: one test run of a step, then every expectation judged against it.

The expectations are parsed before anything runs (a typo is a ConfigError, the
step never starts). Without a `status` expectation the run must have passed: a
run that ended on an error proves nothing, so it never verifies a step.
What defines the step is hashed again after the run: a change while it ran fails
the verification (the run tested something its hash does not name).
The verdict goes into the run's folder (`verification.json`) and the workflow's
history (`runs/test-verifications/verifications.jsonl`), which `sandbox gate` reads.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from sandbox.backends import BackendFactory
from sandbox.contracts.config import load_workflow
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.layout import RunLayout
from sandbox.contracts.record import TestRunRecord
from sandbox.prepare.contenthash import changed_parts, content_hash, not_covered_reason
from sandbox.run.testrun import RunOptions, TestRun
from sandbox.verify import history
from sandbox.verify.check import ExpectationResult, check_all
from sandbox.verify.expect import (
    Named,
    StatusExpectation,
    expectations_digest,
    load_expectations,
)
from sandbox.verify.finished import FinishedStep
from sandbox.verify.seal import seal_results
from sandbox.verify.verification import Verification, digest_of, write_verification

IMPLICIT_STATUS = "status passed (no status expectation given)"


def with_implicit_status(named: list[Named]) -> list[Named]:
    if any(isinstance(n.expectation, StatusExpectation) for n in named):
        return named
    return [*named, Named(label=IMPLICIT_STATUS, expectation=StatusExpectation(kind="status"))]


def judge(
    run: FinishedStep, named: list[Named], extra: list[ExpectationResult] | None = None
) -> Verification:
    """The verdict over a finished run (the run itself is not repeated); `extra`:
    results the caller judged itself (the content check)."""
    ev = run.evidence
    results = [*seal_results(ev.record), *check_all(named, ev), *(extra or [])]
    return Verification(
        run_id=ev.record.id,
        workflow_name=ev.record.workflow_name,
        step_id=ev.record.step_id,
        at=datetime.now(UTC),
        passed=bool(results) and all(r.ok for r in results),
        content=ev.record.content,
        expectations_digest=expectations_digest(named),
        results=results,
        digest=digest_of(ev),
        walls=ev.record.walls,
        replay=ev.record.replay,
    )


def content_kept(wf_dir: Path, step_id: str, record: TestRunRecord) -> list[ExpectationResult]:
    """A failing result when what defines the step changed while it ran (the workflow
    folder is live, read-only, in the step's view): the run then tested something
    other than what its hash names, so it verifies nothing. Nothing when unchanged."""
    if record.content is None:
        return []
    if not record.content.complete:  # the gate would refuse it: the verdict says so first
        return [
            _content_result(
                "a version hash that covers everything", not_covered_reason(record.content)
            )
        ]
    expected = "the step's content unchanged from the run's start to its end"
    try:
        workflow = load_workflow(wf_dir)
        step = workflow.step(step_id)
        now = content_hash(wf_dir, workflow, step, record.images)
    except ConfigError as exc:
        return [_content_result(expected, f"it cannot be read again after the run: {exc}")]
    if now.digest == record.content.digest:
        return []
    changed = ", ".join(changed_parts(record.content.parts, now.parts)[:5])
    return [_content_result(expected, f"changed during the run ({changed})")]


def _content_result(expected: str, happened: str) -> ExpectationResult:
    return ExpectationResult(
        label="content unchanged during the run",
        kind="content",
        ok=False,
        expected=expected,
        happened=happened,
        evidence=["record: content"],
    )


def verify_step(
    workflow_dir: Path | str,
    step_id: str,
    options: RunOptions | None = None,
    *,
    backend: BackendFactory | None = None,
) -> Verification:
    """Run `step_id` once in test mode and judge it; raises ConfigError before the run
    when its expectations do not parse."""
    wf_dir = Path(workflow_dir).absolute()
    workflow = load_workflow(wf_dir)
    step = workflow.step(step_id)
    named = with_implicit_status(load_expectations(wf_dir, workflow, step))
    record = TestRun(wf_dir, step_id, options, backend=backend).execute()
    run_root = RunLayout(wf_dir, record.id, step.group).root
    verification = judge(FinishedStep.load(run_root), named, content_kept(wf_dir, step_id, record))
    write_verification(run_root, verification)
    history.append(wf_dir, verification)
    return verification
