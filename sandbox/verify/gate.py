"""`sandbox gate`: the Pulse rule for a step with external effects.

A step passes the gate when its current version (its content hash, computed now from
the workflow folder and the images as the backend the host's config names gives them
to a test run: the engine's ids, or a cluster's references; see
`sandbox.prepare.contenthash`, where an image named by tag leaves the hash incomplete)
has a passing verification under its current expectations, run with every wall of a
normal run (`Walls.full`), whose run's action log was sealed (see sandbox.verify.seal).
With `allow_no_effects`, a step also passes when it has test runs at the current hash,
each with every wall, and none of them showed an external effect
(`sandbox.verify.effects`: no stubbed, refused or denied call, no DB write, a whole
log). Anything else fails the gate with what is missing, naming the parts that changed
since the last verification. A version whose hash could not cover everything is never
vouched for, and a run whose reads were replayed from a recording counts only when the
host's config accepts replayed verifications.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from sandbox.contracts.config import Step, Workflow, load_workflow
from sandbox.contracts.hostconfig import BackendConfig, load_host_config
from sandbox.contracts.layout import TEST_RUN_PREFIX, is_test_run
from sandbox.contracts.record import ContentHash, TestRunRecord, Walls, read_record
from sandbox.contracts.workflow_record import WorkflowRunRecord, read_any_record
from sandbox.prepare.contenthash import changed_parts, content_hash, not_covered_reason
from sandbox.prepare.plan import images_of
from sandbox.verify import history
from sandbox.verify.effects import why_not_effect_free
from sandbox.verify.expect import expectations_digest, load_expectations
from sandbox.verify.seal import NOT_SEALED, unsealed
from sandbox.verify.verifystep import with_implicit_status


@dataclass(frozen=True)
class GateResult:
    ok: bool
    reason: str


def current_content(
    workflow_dir: Path, workflow: Workflow, step: Step, settings: BackendConfig | None = None
) -> ContentHash:
    """The hash a test run of the step would record now: the images as the backend the
    host's config names gives them to a run (the Docker engine's ids; on Kubernetes the
    references its Pods run, which need no connection to the cluster)."""
    wanted = images_of(workflow)
    if settings is None:
        settings = load_host_config().backend
    if settings.kind == "kubernetes":
        used = {role: settings.image_ref(image) for role, image in wanted.items()}
    else:
        from sandbox.backends.docker.backend import DockerBackend

        with contextlib.closing(DockerBackend.connect()) as backend:
            used = {role: backend.require_image(image) for role, image in wanted.items()}
    return content_hash(workflow_dir, workflow, step, used)


def _records_at(workflow_dir: Path, step_id: str, digest: str) -> list[TestRunRecord]:
    runs = workflow_dir / "runs"
    out: list[TestRunRecord] = []
    if not runs.is_dir() or runs.is_symlink():
        return out
    for path in sorted(runs.iterdir()):
        if not is_test_run(path.name) or path.is_symlink() or not path.is_dir():
            continue
        try:
            record = read_record(path)
        except (OSError, ValueError):
            continue
        if record.step_id == step_id and record.content and record.content.digest == digest:
            out.append(record)
    return out


def _run_unsealed(wf_dir: Path, run_id: str) -> str:
    """Why the verified run's record does not hold up ("" when its log is sealed): the
    record is read again, so a verification whose run was not sealed never passes."""
    if not run_id.startswith(TEST_RUN_PREFIX) or "/" in run_id or run_id in (".", ".."):
        return f"{NOT_SEALED} (no test run {run_id!r})"
    runs = wf_dir / "runs"
    own = runs / run_id
    chain_id, _, index = run_id.rpartition("-s")
    if not own.is_dir() and chain_id and index.isdigit():
        own = runs / chain_id  # a chain step's run: its chain's record sums it up
    if own.is_symlink() or not own.is_dir():
        return f"{NOT_SEALED} (no test run {run_id})"
    try:
        record = read_any_record(own)
    except (OSError, ValueError):
        return f"{NOT_SEALED} (the record of {run_id} is unreadable)"
    if isinstance(record, WorkflowRunRecord) and record.id != run_id:
        entry = next((e for e in record.steps if e.run_id == run_id), None)
        if entry is None:
            return f"{NOT_SEALED} (no test run {run_id})"
        if entry.log_synced_at is None or record.log_synced_at is None:
            return NOT_SEALED
        return ""
    return unsealed(record)


def replayed_from(wf_dir: Path, run_id: str) -> str | None:
    """The run whose recording answered this run's reads (None: a live run), from the
    run's own record (the history line alone is not trusted to say it was live)."""
    if not run_id.startswith(TEST_RUN_PREFIX) or "/" in run_id or run_id in (".", ".."):
        return None
    own = wf_dir / "runs" / run_id
    if own.is_symlink() or not own.is_dir():
        return None
    try:
        record = read_record(own)
    except (OSError, ValueError):
        return None  # an unreadable record is refused as unsealed
    return record.replay.run_id if record.replay is not None else None


def weaker_walls(walls: Walls | None) -> str:
    """Why a run's walls were less than a normal run's ("" when they were all there)."""
    if walls is None:
        return "its walls are not recorded"
    if walls.full:
        return ""
    return "; ".join(walls.lacking) or "it did not have every wall of a normal run"


def gate(
    workflow_dir: Path | str,
    step_id: str,
    *,
    allow_no_effects: bool = False,
    host_config: Path | None = None,
) -> GateResult:
    """`host_config`: the host's settings (None: `$SANDBOX_HOST_CONFIG`, else the default
    path), the ones the runs used: they name the backend that gives the images."""
    wf_dir = Path(workflow_dir).absolute()
    workflow = load_workflow(wf_dir)
    step = workflow.step(step_id)
    host = load_host_config(host_config)
    now = current_content(wf_dir, workflow, step, host.backend)
    if not now.complete:
        return GateResult(False, f"{step_id} not verified: {not_covered_reason(now)}")
    past = history.read(wf_dir, step_id)
    expectations = ""
    if step.expect or step.expect_file:
        expectations = expectations_digest(
            with_implicit_status(load_expectations(wf_dir, workflow, step))
        )
    at_now = [e for e in past if e.content is not None and e.content.digest == now.digest]
    passing = [e for e in at_now if e.passed and e.expectations_digest == expectations]
    walled = [e for e in passing if not weaker_walls(e.walls)]
    replayed = [e for e in walled if replayed_from(wf_dir, e.run_id) is not None]
    if replayed and not host.accept_replayed_verifications:
        walled = [e for e in walled if e not in replayed]
    sealed = [e for e in walled if not _run_unsealed(wf_dir, e.run_id)]
    if sealed:
        return GateResult(True, f"{step_id} verified at its current version ({sealed[-1].run_id})")
    not_accepted = ""
    if replayed and not walled:
        last = replayed[-1]
        not_accepted = (
            f"{step_id} not verified; its verification {last.run_id} was replayed from "
            f"the recording of {replayed_from(wf_dir, last.run_id)}, not run live "
            "(host.toml `accept_replayed_verifications` is off)"
        )
    elif walled:  # none of them sealed
        last_run = walled[-1].run_id
        not_accepted = f"{step_id}: {_run_unsealed(wf_dir, last_run)} ({last_run})"
    elif passing:
        weak = passing[-1]
        not_accepted = (
            f"{step_id} not verified; its verification {weak.run_id} ran with weaker walls "
            f"than a normal run ({weaker_walls(weak.walls)})"
        )
    if allow_no_effects:
        runs = [r for r in _records_at(wf_dir, step_id, now.digest) if not weaker_walls(r.walls)]
        if not host.accept_replayed_verifications:
            runs = [r for r in runs if r.replay is None]  # its reads were not the world's
        shown = [(r, unsealed(r) or why_not_effect_free(r)) for r in runs]
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
    if not_accepted:
        return GateResult(False, not_accepted + effect_note)
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
    host_config: Path | None = None,
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
    host = load_host_config(host_config)
    now = {s.id: current_content(wf_dir, workflow, s, host.backend) for s in chain}
    what = f"the chain {' -> '.join(ids)} ({expectations.source})"
    for i in ids:
        if not now[i].complete:
            return GateResult(False, f"{what} not verified: {i}: {not_covered_reason(now[i])}")
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

    def weak(entry: history.WorkflowHistoryEntry) -> str:
        return "; ".join(f"{i}: {why}" for i in ids if (why := weaker_walls(entry.walls.get(i))))

    walled = [e for e in passing if not weak(e)]
    sealed = [e for e in walled if not _run_unsealed(wf_dir, e.run_id)]
    if sealed:
        return GateResult(True, f"{what} verified at its current version ({sealed[-1].run_id})")
    if walled:
        last_run = walled[-1].run_id
        return GateResult(False, f"{what}: {_run_unsealed(wf_dir, last_run)} ({last_run})")
    if passing:
        return GateResult(
            False,
            f"{what} not verified: its verification {passing[-1].run_id} ran with weaker "
            f"walls than a normal run ({weak(passing[-1])})",
        )
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
