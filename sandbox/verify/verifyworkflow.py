"""`verify_workflow`: a whole chain run once in test mode, then every expectation judged.

The workflow's expectations file is parsed before anything runs (a typo is a
ConfigError; a step it names outside `--from/--to` too). Each step's
expectations are judged against that step's own test run inside the chain; the
chain's against every step's action-log lines and the chain's DB diff. Line
numbers are the chain's action log's (`runs/test-<id>/test_mode_actions.jsonl`,
which holds each step's log, byte for byte, in the order they ran), and every
citation names its step. A step that never ran (skipped, or the runner stopped)
fails each of its expectations, saying why. What defines each step is hashed
again after the chain: a change while it ran fails that step.

The verdict goes into the run folder (`verification.json`, `kind: workflow`) and
the workflow's history (`runs/test-verifications/workflow_verifications.jsonl`, which `sandbox gate
--workflow` reads). A step whose own expectations (`own = true`) held in the
chain gets a line in the step history too, so `sandbox gate WORKFLOW STEP`
counts the chain's verification of it.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from sandbox.backends import BackendFactory
from sandbox.contracts.config import load_workflow
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.layout import WorkflowRunLayout
from sandbox.contracts.workflow_record import WorkflowRunRecord
from sandbox.run.workflowrun import WorkflowOptions, WorkflowRun, chain_of
from sandbox.verify import history
from sandbox.verify.check import ExpectationResult, check_all
from sandbox.verify.evidence import Evidence
from sandbox.verify.expect import Named
from sandbox.verify.finished import FinishedChain
from sandbox.verify.seal import seal_results
from sandbox.verify.verification import digest_of
from sandbox.verify.verifystep import content_kept
from sandbox.verify.workflow_expect import (
    StepPlan,
    WorkflowExpectations,
    load_workflow_expectations,
)
from sandbox.verify.workflow_verification import (
    ChainDigest,
    StepVerdict,
    WorkflowVerification,
    write_workflow_verification,
)


def _not_run(named: list[Named], why: str) -> list[ExpectationResult]:
    return [
        ExpectationResult(
            label=n.label,
            kind=n.expectation.kind,
            ok=False,
            expected=n.expectation.describe(),
            happened=f"not judged: {why}",
            evidence=["workflow record: steps"],
        )
        for n in named
    ]


def _step_verdict(
    workflow_dir: Path,
    record: WorkflowRunRecord,
    index: int,
    plan: StepPlan | None,
    ev: Evidence | None,
    own: list[Named],
) -> StepVerdict:
    entry = record.steps[index]
    named = plan.expectations if plan is not None else []
    if ev is None:
        why = f"step {entry.step_id} did not run ({entry.status.value}"
        why += f": {entry.reason})" if entry.reason else ")"
        results = _not_run(named, why)
        return StepVerdict(
            index=entry.index,
            step_id=entry.step_id,
            run_id=entry.run_id,
            status=entry.status.value,
            passed=not results,
            own_expectations_digest=plan.own_digest if plan else None,
            own_passed=False if plan and plan.own_digest else None,
            results=results,
        )
    kept = content_kept(workflow_dir, entry.step_id, ev.record) if named else []
    results = [*check_all(named, ev), *kept] if named else []
    own_passed = None
    if plan is not None and plan.own_digest is not None:
        own_passed = all(r.ok for r in check_all(own, ev)) and not kept
    return StepVerdict(
        index=entry.index,
        step_id=entry.step_id,
        run_id=entry.run_id,
        status=entry.status.value,
        passed=all(r.ok for r in results),
        content=ev.record.content,
        walls=ev.record.walls,
        own_expectations_digest=plan.own_digest if plan else None,
        own_passed=own_passed,
        results=results,
        digest=digest_of(ev),
    )


def judge_workflow(
    run: FinishedChain,
    expectations: WorkflowExpectations,
    own: dict[str, list[Named]] | None = None,
) -> WorkflowVerification:
    """The verdict over a finished chain (nothing runs again). `own`: the steps' own
    expectations (with their implicit status), judged alone as well."""
    record = run.record
    workflow_dir = Path(record.workflow_dir)
    steps, chain_ev = run.steps, run.chain
    ran = {e.step_id for e in record.steps}
    verdicts = []
    for index, entry in enumerate(record.steps):
        plan = expectations.step(entry.step_id)
        verdicts.append(
            _step_verdict(
                workflow_dir,
                record,
                index,
                plan,
                steps.get(entry.step_id),
                (own or {}).get(entry.step_id, []),
            )
        )
    missing = [p for p in expectations.steps if p.step_id not in ran]
    chain_results = [*seal_results(record), *check_all(expectations.chain, chain_ev)]
    chain_results += [
        r
        for p in missing
        for r in _not_run(p.expectations, f"step {p.step_id} is not in this chain")
    ]
    stubbed: Counter[str] = Counter(
        c.line.tool for c in chain_ev.calls if c.line.decision == "stub"
    )
    digest = ChainDigest(
        status=record.status.value,
        steps=[f"{e.step_id} {e.status.value}" for e in record.steps],
        stubbed=dict(stubbed),
        db=record.db_diff.summary_lines() if record.db_diff is not None else [],
    )
    passed = all(v.passed for v in verdicts) and all(r.ok for r in chain_results)
    return WorkflowVerification(
        run_id=record.id,
        workflow_name=record.workflow_name,
        at=datetime.now(UTC),
        passed=passed and bool(chain_results),
        expectations_file=expectations.source,
        expectations_digest=expectations.digest,
        from_step=record.from_step,
        to_step=record.to_step,
        chain_steps=[e.step_id for e in record.steps],
        steps=verdicts,
        chain=chain_results,
        digest=digest,
    )


def _own_expectations(
    workflow_dir: Path, expectations: WorkflowExpectations
) -> dict[str, list[Named]]:
    from sandbox.verify.expect import load_expectations
    from sandbox.verify.verifystep import with_implicit_status

    workflow = load_workflow(workflow_dir)
    return {
        p.step_id: with_implicit_status(
            load_expectations(workflow_dir, workflow, workflow.step(p.step_id))
        )
        for p in expectations.steps
        if p.own_digest is not None
    }


def record_history(workflow_dir: Path, verification: WorkflowVerification) -> None:
    """The chain's line in the workflow history; a line in the step history for each
    step whose own expectations were judged (held or not) at its hash."""
    history.append_workflow(
        workflow_dir,
        history.WorkflowHistoryEntry(
            run_id=verification.run_id,
            at=verification.at,
            passed=verification.passed,
            expectations_file=verification.expectations_file,
            expectations_digest=verification.expectations_digest,
            chain_steps=verification.chain_steps,
            content={s.step_id: s.content for s in verification.steps if s.content is not None},
            failed=verification.failed,
            walls={s.step_id: s.walls for s in verification.steps if s.walls is not None},
        ),
    )
    for step in verification.steps:
        if step.own_expectations_digest is None or step.run_id is None or step.content is None:
            continue
        history.append_entry(
            workflow_dir,
            history.HistoryEntry(
                run_id=step.run_id,
                step_id=step.step_id,
                at=verification.at,
                passed=bool(step.own_passed),
                content=step.content,
                expectations_digest=step.own_expectations_digest,
                failed=[] if step.own_passed else [r.label for r in step.results if not r.ok],
                walls=step.walls,
            ),
        )


def verify_workflow(
    workflow_dir: Path | str,
    expectations_file: Path | str,
    options: WorkflowOptions | None = None,
    *,
    backend: BackendFactory | None = None,
) -> WorkflowVerification:
    """Run the chain once in test mode and judge it; raises ConfigError before the run
    when the expectations do not parse or name a step outside the chain."""
    wf_dir = Path(workflow_dir).absolute()
    options = options or WorkflowOptions()
    workflow = load_workflow(wf_dir)
    expectations = load_workflow_expectations(wf_dir, workflow, expectations_file)
    chain = [s.id for s in chain_of(workflow, options.from_step, options.to_step)]
    outside = [p.step_id for p in expectations.steps if p.step_id not in chain]
    if outside:
        raise ConfigError(
            f"{expectations.source}: step(s) {', '.join(outside)} not in the chain "
            f"({' -> '.join(chain)})"
        )
    own = _own_expectations(wf_dir, expectations)
    record = WorkflowRun(wf_dir, options, backend=backend).execute()
    run_root = WorkflowRunLayout(wf_dir, record.id).root
    verification = judge_workflow(FinishedChain.load(run_root), expectations, own)
    write_workflow_verification(run_root, verification)
    record_history(wf_dir, verification)
    return verification
