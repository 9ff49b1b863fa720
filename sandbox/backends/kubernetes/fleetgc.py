"""`sandbox gc` for the scheduler placement: runs whose runner's Pod ended unfinished.

A fleet runner that dies (killed, its node lost) cannot clean up after itself, and
no runner of another node knows it is dead; the cluster does: its Job's Pod has
ended. For each such Pod (never a live one) this marks the run's record on the claim
`killed` if it still says `running` (the controller's view of the claim, at the
workflow path the controller annotated on the Job and the run id the runner
announced on its Pod, both checked against their shapes), deletes the run's Pod and
Secret, the Lease the dead runner held, and the Job (one gone already is fine: the
cluster deletes a Secret with its Pod meanwhile). What the runner mounted on its
node (the step's disk and view) only a privileged Pod on that node can remove: gc
submits a cleanup Job pinned there (`fleetclean`), waits for it (bounded), reports
what it removed and deletes it; one that has not ended by then is left to finish
(it has a deadline and goes by itself once ended) and named in the report's errors.
A chain's step runner is found the same way; its record is the step's folder under
the chain's `steps/`, and its cleanup Job reaps the whole chain's folder.

A chain whose controller died (`fleetchain`: SIGKILL, its host lost) leaves its own
record `running`. Its controller left a marker (`lease.mark_chain`) beside the
workflow's Lease it holds: when that Lease is gone (deleted, taken by another
holder, or expired: `lease.chain_gone`) and no runner Pod of the chain is still
running (a step's runner renews the Lease while it runs, and seals its own record),
the controller is provably gone. Then the chain is recorded `killed` as a chain
whose runner died on one host (`mark_killed`: the step it was in killed, the rest
skipped; a step record its dead runner left `running` marked `killed` first), its
remaining Jobs and the dead Lease deleted, and the marker with them. A live chain
(its Lease renewed, or a step's runner running) is never touched.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from pathlib import Path, PurePosixPath
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from sandbox.backends.docker.gc import GcReport, mark_killed
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.layout import STEPS_DIR, new_step_run_id
from sandbox.contracts.names import LABEL_RUN_ID
from sandbox.contracts.record import RunStatus
from sandbox.contracts.workflow_record import WorkflowRunRecord, read_any_record

from .fleet import (
    ANNOTATION_CHAIN,
    ANNOTATION_RUN_ID,
    ANNOTATION_WORKFLOW,
    LABEL_FLEET,
    LABEL_JOB,
    RUN_ID,
)
from .fleetclean import REMOVED_MARK, cleanup_job_manifest
from .lease import (
    ANNOTATION_CHAIN_RUN,
    chain_gone,
    chain_markers,
    drop_job_start,
    lease_name,
    unmark_chain,
)

CLEANUP_WAIT_S = 120.0  # gc waits this long for the nodes' cleanup Jobs, all together


def _run_root(settings: BackendConfig, annotations: dict[str, str]) -> Path | None:
    """The run folder on the controller's view of the claim: `runs/<id>`, or for a
    chain's step its folder under the chain's `steps/` (each name checked)."""
    workflow, run_id = annotations.get(ANNOTATION_WORKFLOW), annotations.get(ANNOTATION_RUN_ID)
    if settings.claim_root is None or not workflow or not run_id or not RUN_ID.match(run_id):
        return None
    rel = PurePosixPath(workflow)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        return None
    runs = Path(settings.claim_root) / rel / "runs"
    chain = annotations.get(ANNOTATION_CHAIN)
    if chain is None:
        return runs / run_id
    if not RUN_ID.match(chain):
        return None
    return _step_root(runs / chain, run_id)


def _step_root(chain_root: Path, step_run_id: str) -> Path | None:
    """A chain step's folder (`steps/<index>-<step>`, a real folder) by its run id."""
    index = step_run_id.rpartition("-s")[2]
    if not index.isdigit() or new_step_run_id(chain_root.name, int(index)) != step_run_id:
        return None
    steps = chain_root / STEPS_DIR
    try:
        if steps.is_symlink():
            return None
        found = [
            p
            for p in steps.iterdir()
            if p.name.startswith(f"{int(index)}-") and p.is_dir() and not p.is_symlink()
        ]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


def collect_fleet(api: Any, settings: BackendConfig, report: GcReport) -> None:
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    coordination = client.CoordinationV1Api(api)
    namespace = settings.namespace
    try:
        runners = core.list_namespaced_pod(namespace, label_selector=f"{LABEL_FLEET}=true").items
    except ApiException as exc:
        report.errors.append(f"cluster: listing fleet runners in {namespace}: {exc.reason}")
        return
    cleanups: list[tuple[str, str]] = []  # (Job, node)
    for runner in runners:
        if (runner.status.phase or "") not in ("Succeeded", "Failed"):
            continue  # a live runner cleans up after itself
        annotations = runner.metadata.annotations or {}
        root = _run_root(settings, annotations)
        if root is not None and mark_killed(root, runner_dead=True):
            report.records_marked_killed.append(str(root))
        run_id = annotations.get(ANNOTATION_RUN_ID)
        try:
            if run_id and RUN_ID.match(run_id):
                selector = f"{LABEL_RUN_ID}={run_id}"
                # Each gone already is fine: the cluster deletes a Secret with its Pod
                # (its owner) while this loop runs, and the rest must still be done.
                for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
                    name = pod.metadata.name
                    if _deleted(
                        core.delete_namespaced_pod, name, namespace, grace_period_seconds=0
                    ):
                        report.pods_removed.append(name)
                for secret in core.list_namespaced_secret(namespace, label_selector=selector).items:
                    name = secret.metadata.name
                    if _deleted(core.delete_namespaced_secret, name, namespace):
                        report.secrets_removed.append(name)
            workflow = annotations.get(ANNOTATION_WORKFLOW)
            node = runner.spec.node_name
            if root is not None and workflow and run_id and node:
                # A chain's step: the chain's id, whose cleanup reaps every step's folder.
                cleanup = annotations.get(ANNOTATION_CHAIN) or run_id
                cleanups.append((_submit_cleanup(batch, settings, workflow, cleanup, node), node))
            if workflow:
                _drop_lease(coordination, namespace, lease_name(workflow), runner.metadata.name)
            job = (runner.metadata.labels or {}).get(LABEL_JOB)
            if job:
                _deleted(
                    batch.delete_namespaced_job, job, namespace, propagation_policy="Background"
                )
                drop_job_start(api, namespace, job)
        except ApiException as exc:
            if exc.status != 404:
                report.errors.append(f"cluster: fleet runner {runner.metadata.name}: {exc.reason}")
    running = {
        (r.metadata.annotations or {}).get(ANNOTATION_CHAIN)
        for r in runners
        if (r.status.phase or "") not in ("Succeeded", "Failed")
    }
    _collect_dead_chains(api, settings, running, report)
    _await_cleanups(core, batch, namespace, cleanups, report)


def _collect_dead_chains(
    api: Any, settings: BackendConfig, running: set[str | None], report: GcReport
) -> None:
    """Each chain whose controller is provably gone, recorded `killed` (module doc).
    `running`: the chains of the runner Pods that had not ended when listed."""
    namespace = settings.namespace
    try:
        markers = chain_markers(api, namespace)
    except ApiException as exc:
        report.errors.append(f"cluster: listing fleet chains in {namespace}: {exc.reason}")
        return
    for marker in markers:
        holder = marker.metadata.name
        annotations = marker.metadata.annotations or {}
        workflow, chain_id = (
            annotations.get(ANNOTATION_WORKFLOW),
            annotations.get(ANNOTATION_CHAIN_RUN),
        )
        if not workflow or not chain_id or chain_id in running:
            continue  # a step's runner still runs (it renews the chain's Lease)
        try:
            if not chain_gone(api, namespace, workflow, holder):
                continue  # its controller (or a step's runner) renews the Lease
        except ApiException as exc:
            report.errors.append(f"cluster: the Lease of chain {chain_id}: {exc.reason}")
            continue
        root = _run_root(settings, {ANNOTATION_WORKFLOW: workflow, ANNOTATION_RUN_ID: chain_id})
        if root is not None:
            _mark_chain_killed(root, report)
        try:
            _delete_chain_jobs(api, namespace, chain_id)
        except ApiException as exc:
            report.errors.append(f"cluster: the Jobs of chain {chain_id}: {exc.reason}")
            continue
        unmark_chain(api, namespace, holder)


def _mark_chain_killed(root: Path, report: GcReport) -> None:
    """A chain left `running`: the step record its dead runner left `running` killed,
    then the chain, as on one host (`mark_killed`)."""
    try:
        chain = read_any_record(root)
    except (OSError, ValueError):
        return
    if not isinstance(chain, WorkflowRunRecord) or chain.status is not RunStatus.RUNNING:
        return
    for entry in chain.steps:
        rel = PurePosixPath(entry.record or "")
        if not entry.record or rel.is_absolute() or ".." in rel.parts or len(rel.parts) < 2:
            continue
        step_root = root / rel.parent
        if step_root.is_relative_to(root / STEPS_DIR) and mark_killed(step_root, runner_dead=True):
            report.records_marked_killed.append(str(step_root))
    if mark_killed(root, runner_dead=True, who="controller"):
        report.records_marked_killed.append(str(root))


def _delete_chain_jobs(api: Any, namespace: str, chain_id: str) -> None:
    """The chain's step Jobs still there (their runners ended), and their start marks."""
    batch = client.BatchV1Api(api)
    for job in batch.list_namespaced_job(namespace, label_selector=f"{LABEL_FLEET}=true").items:
        template = job.spec.template.metadata
        if ((template and template.annotations) or {}).get(ANNOTATION_CHAIN) != chain_id:
            continue
        with contextlib.suppress(ApiException):
            batch.delete_namespaced_job(
                job.metadata.name, namespace, propagation_policy="Background"
            )
        drop_job_start(api, namespace, job.metadata.name)


def _submit_cleanup(
    batch: Any, settings: BackendConfig, workflow: str, run_id: str, node: str
) -> str:
    """The dead run's mounts on its node: a cleanup Job pinned there (`fleetclean`)."""
    name = f"sandbox-clean-{secrets.token_hex(5)}"
    manifest = cleanup_job_manifest(settings, workflow, run_id, node, name)
    batch.create_namespaced_job(settings.namespace, manifest)
    return name


def _await_cleanups(
    core: Any, batch: Any, namespace: str, jobs: list[tuple[str, str]], report: GcReport
) -> None:
    """Each cleanup Job's removed paths into the report, once its Pod ended; the Job
    deleted then. One still running at the deadline is named in the errors."""
    deadline = time.monotonic() + CLEANUP_WAIT_S
    pending = dict(jobs)
    while pending:
        for name, node in list(pending.items()):
            try:
                pods = core.list_namespaced_pod(namespace, label_selector=f"job-name={name}").items
            except ApiException as exc:
                report.errors.append(f"cluster: cleanup Job {name}: {exc.reason}")
                del pending[name]
                continue
            ended = [p for p in pods if (p.status.phase or "") in ("Succeeded", "Failed")]
            if not ended:
                continue
            pod = ended[0]
            with contextlib.suppress(ApiException):
                log = core.read_namespaced_pod_log(pod.metadata.name, namespace)
                report.mounts_removed += [
                    line[len(REMOVED_MARK) :]
                    for line in str(log).splitlines()
                    if line.startswith(REMOVED_MARK)
                ]
            if pod.status.phase != "Succeeded":
                report.errors.append(f"node {node}: cleanup Job {name} failed (see its log)")
            else:
                with contextlib.suppress(ApiException):
                    batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
            del pending[name]
        if pending and time.monotonic() >= deadline:
            for name, node in pending.items():
                report.errors.append(
                    f"node {node}: cleanup Job {name} has not ended; it goes on (its deadline: "
                    "the Job's activeDeadlineSeconds)"
                )
            return
        if pending:
            time.sleep(1.0)


def _deleted(delete: Any, name: str, namespace: str, **options: Any) -> bool:
    """`delete(name, namespace, **options)`: True when this call deleted it, False when it
    was gone already (404); any other refusal is raised."""
    try:
        delete(name, namespace, **options)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def _drop_lease(coordination: Any, namespace: str, name: str, holder: str) -> None:
    """The dead runner's Lease, only if it still holds it."""
    try:
        lease = coordination.read_namespaced_lease(name, namespace)
    except ApiException:
        return
    if lease.spec.holder_identity == holder:
        _deleted(
            coordination.delete_namespaced_lease,
            name,
            namespace,
            body=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(uid=lease.metadata.uid)
            ),
        )
