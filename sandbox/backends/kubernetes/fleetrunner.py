"""The runner inside a fleet Job's Pod: one test run on the node the scheduler picked.

Started by `fleet.job_manifest` as `python3 -m sandbox.backends.kubernetes.fleetrunner
<workflow under the claim> <step>`. Its settings come from the Job (the controller's,
with the claim at `/claim` and in-cluster credentials), its node from the downward
API: the run's Pod is pinned to this node, whose kernel holds the disk and view this
runner mounts. It first marks its Job started (a Pod the Job made again after an
eviction refuses: a run is never repeated), then takes the workflow's Lease
(`lease`): two runners on two nodes exclude each other as two runners of one host
do. SIGTERM (the Job deleted, its Pod evicted) ends the run as `killed`, as it does
for `sandbox run`. The last line
names the run (or why it was refused), for the controller to read its record.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path, PurePosixPath

from kubernetes import client

from sandbox import stopsignals
from sandbox.backends.choose import connect_backend
from sandbox.contracts.events import RunEvent
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.run.testrun import RunInterrupted, RunOptions, TestRun

from .fleet import (
    ANNOTATION_RUN_ID,
    NODE_ENV,
    POD_ENV,
    REFUSED_MARK,
    RUN_ID_MARK,
    RUNNER_CLAIM_ROOT,
    SETTINGS_ENV,
)
from .lease import LeaseHeldError, WorkflowLease, claim_job_start
from .podrun import connect


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: fleetrunner <workflow under the claim> <step>", file=sys.stderr)
        return 2
    workflow, step_id = argv
    rel = PurePosixPath(workflow)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        print(f"fleetrunner: {workflow!r} is not a folder under the claim", file=sys.stderr)
        return 2
    settings = BackendConfig.model_validate_json(os.environ[SETTINGS_ENV])
    settings = settings.model_copy(update={"node_name": os.environ[NODE_ENV]})
    stopsignals.on_stop(signal.SIGTERM, RunInterrupted)
    api = connect(settings)
    repeated = claim_job_start(api, settings.namespace, os.environ[POD_ENV])
    if repeated is not None:
        print(f"{REFUSED_MARK}{repeated}", flush=True)
        api.close()
        return 3
    lease = WorkflowLease(api, settings.namespace, rel.as_posix(), os.environ[POD_ENV])
    try:
        lease.acquire()
    except LeaseHeldError as exc:
        print(f"{REFUSED_MARK}{exc}", flush=True)
        api.close()
        return 3
    core = client.CoreV1Api(api)
    pod = os.environ[POD_ENV]
    announced: list[str] = []

    def announce(event: RunEvent) -> None:
        """The run's id on this Pod, at its first event: `sandbox gc` finds the record
        of a runner that died from it."""
        if announced:
            return
        announced.append(event.run_id)
        body = {"metadata": {"annotations": {ANNOTATION_RUN_ID: event.run_id}}}
        core.patch_namespaced_pod(pod, settings.namespace, body)

    try:
        record = TestRun(
            Path(RUNNER_CLAIM_ROOT) / rel,
            step_id,
            RunOptions(on_event=announce),
            backend=lambda: connect_backend(settings),
        ).execute()
    finally:
        lease.release()
        api.close()
    print(f"status {record.status.value} on {record.node}", flush=True)
    print(f"{RUN_ID_MARK}{record.id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
