"""`sandbox gate`: the Pulse rule for a step with external effects.

A step passes the gate when its current content hash (computed now, from the
workflow folder and the images on this host, exactly as a test run computes
it) has a passing verification under its current expectations. With
`allow_no_effects`, a step also passes when it has test runs at the current hash
and none of them showed an effect (`sandbox.verify.effects`: no stubbed, refused
or denied call, no DB write, a whole log). Anything else fails the gate with
what is missing, naming the parts that changed since the last verification.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from sandbox.contracts import names
from sandbox.contracts.config import Step, Workflow, load_workflow
from sandbox.contracts.layout import TEST_RUN_PREFIX
from sandbox.contracts.record import ContentHash, TestRunRecord, read_record
from sandbox.launch import specs as launch
from sandbox.prepare.contenthash import changed_parts, content_hash, read_prompt
from sandbox.verify import history
from sandbox.verify.effects import why_not_effect_free
from sandbox.verify.expect import expectations_digest, load_expectations
from sandbox.verify.verifystep import with_implicit_status


@dataclass(frozen=True)
class GateResult:
    ok: bool
    reason: str


def current_content(workflow_dir: Path, workflow: Workflow, step: Step) -> ContentHash:
    """The hash a test run of the step would record now (the images' ids from the
    engine, through the same backend a run uses)."""
    from sandbox.backends.docker.backend import DockerBackend

    with contextlib.closing(DockerBackend.connect()) as backend:
        used = {"step": backend.require_image(names.STEP_IMAGE)}
        if launch.stdio_servers(workflow):
            used["mcp"] = backend.require_image(names.MCP_IMAGE)
    return content_hash(workflow_dir, workflow, step, read_prompt(workflow_dir, step), used)


def _records_at(workflow_dir: Path, step_id: str, digest: str) -> list[TestRunRecord]:
    runs = workflow_dir / "runs"
    out: list[TestRunRecord] = []
    if not runs.is_dir() or runs.is_symlink():
        return out
    for path in sorted(runs.iterdir()):
        if not path.name.startswith(TEST_RUN_PREFIX) or path.is_symlink() or not path.is_dir():
            continue
        try:
            record = read_record(path)
        except (OSError, ValueError):
            continue
        if record.step_id == step_id and record.content and record.content.digest == digest:
            out.append(record)
    return out


def gate(workflow_dir: Path | str, step_id: str, *, allow_no_effects: bool = False) -> GateResult:
    wf_dir = Path(workflow_dir).absolute()
    workflow = load_workflow(wf_dir)
    step = workflow.step(step_id)
    now = current_content(wf_dir, workflow, step)
    past = history.read(wf_dir, step_id)
    expectations = ""
    if step.expect or step.expect_file:
        expectations = expectations_digest(
            with_implicit_status(load_expectations(wf_dir, workflow, step))
        )
    at_now = [e for e in past if e.content is not None and e.content.digest == now.digest]
    passing = [e for e in at_now if e.passed and e.expectations_digest == expectations]
    if passing:
        return GateResult(True, f"{step_id} verified at its current version ({passing[-1].run_id})")
    if allow_no_effects:
        runs = _records_at(wf_dir, step_id, now.digest)
        shown = [(r, why_not_effect_free(r)) for r in runs]
        if runs and not any(effect for _, effect in shown):
            return GateResult(
                True,
                f"{step_id} showed no external effect in {len(runs)} test run(s) at its "
                "current version",
            )
        if runs:
            first = next((r, effect) for r, effect in shown if effect)
            effect_note = f"; run {first[0].id} showed an external effect: {first[1]}"
        else:
            effect_note = "; no test run at its current version to show it has no effects"
    else:
        effect_note = ""
    if at_now:
        last = at_now[-1]
        if last.passed:
            why = f"{step_id}'s expectations changed since its last verification ({last.run_id})"
        else:
            failed = ", ".join(last.failed[:3]) or "?"
            why = (
                f"{step_id}'s last verification at its current version failed "
                f"({last.run_id}: {failed})"
            )
        return GateResult(False, why + effect_note)
    verified = [e for e in past if e.passed and e.content is not None]
    if verified:
        last_ok = verified[-1]
        assert last_ok.content is not None
        changed = changed_parts(last_ok.content.parts, now.parts)
        shown_parts = ", ".join(changed[:5]) + (
            f", +{len(changed) - 5} more" if len(changed) > 5 else ""
        )
        return GateResult(
            False, f"{step_id} changed since its last verification ({shown_parts})" + effect_note
        )
    return GateResult(False, f"{step_id} has no passing verification" + effect_note)


def gate_workflow(
    workflow_dir: Path | str,
    expectations_file: Path | str,
    *,
    from_step: str | None = None,
    to_step: str | None = None,
) -> GateResult:
    """The Pulse rule for a chain: a passing workflow verification of these steps
    (`from_step`..`to_step`, the whole order by default) under the file's current
    expectations, with every step at its current content hash."""
    from sandbox.run.workflowrun import chain_of
    from sandbox.verify.workflow_expect import load_workflow_expectations

    wf_dir = Path(workflow_dir).absolute()
    workflow = load_workflow(wf_dir)
    expectations = load_workflow_expectations(wf_dir, workflow, expectations_file)
    chain = chain_of(workflow, from_step, to_step)
    ids = [s.id for s in chain]
    now = {s.id: current_content(wf_dir, workflow, s) for s in chain}
    what = f"the chain {' -> '.join(ids)} ({expectations.source})"
    past = [
        e
        for e in history.read_workflow(wf_dir)
        if e.chain_steps == ids and e.expectations_file == expectations.source
    ]

    def at_now(entry: history.WorkflowHistoryEntry) -> bool:
        return all(
            entry.content.get(i) is not None and entry.content[i].digest == now[i].digest
            for i in ids
        )

    current = [e for e in past if at_now(e)]
    passing = [e for e in current if e.passed and e.expectations_digest == expectations.digest]
    if passing:
        return GateResult(True, f"{what} verified at its current version ({passing[-1].run_id})")
    if current:
        last = current[-1]
        if last.passed:
            return GateResult(
                False,
                f"{what}: the expectations changed since its last verification ({last.run_id})",
            )
        failed = "; ".join(last.failed[:3]) or "?"
        return GateResult(
            False,
            f"{what}: its last verification at the current version failed "
            f"({last.run_id}: {failed})",
        )
    verified = [e for e in past if e.passed]
    if verified:
        last_ok = verified[-1]
        changed: list[str] = []
        for i in ids:
            before = last_ok.content.get(i)
            if before is None:
                changed.append(f"{i}: not in that run")
            elif before.digest != now[i].digest:
                parts = changed_parts(before.parts, now[i].parts)
                changed.append(f"{i}: {', '.join(parts[:5])}")
        return GateResult(
            False, f"{what} changed since its last verification ({'; '.join(changed)})"
        )
    return GateResult(False, f"{what} has no passing verification")
