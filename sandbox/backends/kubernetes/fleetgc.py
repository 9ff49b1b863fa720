"""`sandbox gc` for the scheduler placement: runs whose runner's Pod ended unfinished.

A fleet runner that dies (killed, its node lost) cannot clean up after itself, and
no runner of another node knows it is dead; the cluster does: its Job's Pod has
ended. For each such Pod (never a live one) this marks the run's record on the claim
`killed` if it still says `running` (the controller's view of the claim, at the
workflow path the controller annotated on the Job and the run id the runner
announced on its Pod, both checked against their shapes), deletes the run's Pod and
Secret, the Lease the dead runner held, and the Job. What the runner mounted on its
node (the step's disk and view) only a privileged Pod on that node can remove: gc
submits a cleanup Job pinned there (`fleetclean`), waits for it (bounded), reports
what it removed and deletes it; one that has not ended by then is left to finish
(it has a deadline and goes by itself once ended) and named in the report's errors.
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
from sandbox.contracts.names import LABEL_RUN_ID

from .fleet import ANNOTATION_RUN_ID, ANNOTATION_WORKFLOW, LABEL_FLEET, LABEL_JOB, RUN_ID
from .fleetclean import REMOVED_MARK, cleanup_job_manifest
from .lease import drop_job_start, lease_name

CLEANUP_WAIT_S = 120.0  # gc waits this long for the nodes' cleanup Jobs, all together


def _run_root(settings: BackendConfig, annotations: dict[str, str]) -> Path | None:
    workflow, run_id = annotations.get(ANNOTATION_WORKFLOW), annotations.get(ANNOTATION_RUN_ID)
    if settings.claim_root is None or not workflow or not run_id or not RUN_ID.match(run_id):
        return None
    rel = PurePosixPath(workflow)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        return None
    return Path(settings.claim_root) / rel / "runs" / run_id


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
                for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
                    core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
                    report.pods_removed.append(pod.metadata.name)
                for secret in core.list_namespaced_secret(namespace, label_selector=selector).items:
                    core.delete_namespaced_secret(secret.metadata.name, namespace)
                    report.secrets_removed.append(secret.metadata.name)
            workflow = annotations.get(ANNOTATION_WORKFLOW)
            node = runner.spec.node_name
            if root is not None and workflow and run_id and node:
                cleanups.append((_submit_cleanup(batch, settings, workflow, run_id, node), node))
            if workflow:
                _drop_lease(coordination, namespace, lease_name(workflow), runner.metadata.name)
            job = (runner.metadata.labels or {}).get(LABEL_JOB)
            if job:
                batch.delete_namespaced_job(job, namespace, propagation_policy="Background")
                drop_job_start(api, namespace, job)
        except ApiException as exc:
            if exc.status != 404:
                report.errors.append(f"cluster: fleet runner {runner.metadata.name}: {exc.reason}")
    _await_cleanups(core, batch, namespace, cleanups, report)


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


def _drop_lease(coordination: Any, namespace: str, name: str, holder: str) -> None:
    """The dead runner's Lease, only if it still holds it."""
    try:
        lease = coordination.read_namespaced_lease(name, namespace)
    except ApiException:
        return
    if lease.spec.holder_identity == holder:
        coordination.delete_namespaced_lease(
            name,
            namespace,
            body=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(uid=lease.metadata.uid)
            ),
        )
