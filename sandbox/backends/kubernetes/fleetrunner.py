"""The runner inside a fleet Job's Pod: one test run on the node the scheduler picked.

Started by `fleet.job_manifest` as `python3 -m sandbox.backends.kubernetes.fleetrunner
<workflow under the claim> <step> [options]`. Its settings come from the Job (the
controller's, with the claim at `/claim` and in-cluster credentials; the controller's
`durability` and `[recording]`, `fleet.Carried`, which the run honours as a one-host
run honours its host's), its node from
the downward API: the run's Pod is pinned to this node, whose kernel holds the disk
and view this runner mounts. It first marks its Job started (a Pod the Job made
again after an eviction refuses: a run is never repeated), then takes the workflow's
Lease (`lease`): two runners on two nodes exclude each other as two runners of one
host do. SIGTERM (the Job deleted, its Pod evicted) ends the run as `killed`, as it
does for `sandbox run`. The last line names the run (or why it was refused), for
the controller to read its record.

What it does, one code path each as on a host:
- a step's run (`TestRun.execute`);
- `--verify`: the step's run judged (`verify_step`): the verification lands beside
  the record on the claim and in the workflow's history there, which the
  controller's `sandbox verify` and `sandbox gate` read;
- `--chain RUN --index N --seed-db S --seed-group S --lease-holder H`: one step of a
  chain the controller sequences (`sandbox.run.fleetchain`): the step's run in its
  place under the chain's folder (`TestRun.run_held`), seeded from what the chain's
  earlier steps left there (or the real DB and newest real run: `real`; nothing:
  `-`), under the chain's Lease (joined, never taken: the chain holds it between
  steps) and this node's file lock.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path, PurePosixPath
from typing import Any

from kubernetes import client

from sandbox import stopsignals
from sandbox.backends.choose import connect_backend
from sandbox.contracts.errors import RefusedError, SandboxError
from sandbox.contracts.events import RunEvent
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.layout import WorkflowRunLayout
from sandbox.contracts.record import TestRunRecord
from sandbox.prepare.lock import workflow_run_lock
from sandbox.run.testrun import RunInterrupted, RunOptions, Seed, TestRun

from .fleet import (
    ANNOTATION_RUN_ID,
    CARRIED_ENV,
    NODE_ENV,
    POD_ENV,
    REFUSED_MARK,
    RUN_ID,
    RUN_ID_MARK,
    RUNNER_CLAIM_ROOT,
    SETTINGS_ENV,
    Carried,
)
from .lease import WorkflowLease, claim_job_start
from .podrun import connect

SEED_REAL = "real"  # the real DB / the newest real run of the step's group
SEED_NONE = "-"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetrunner")
    parser.add_argument("workflow")
    parser.add_argument("step_id")
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--chain", default=None)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--seed-db", default=SEED_NONE)
    parser.add_argument("--seed-group", default=SEED_NONE)
    parser.add_argument("--lease-holder", default=None)
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    rel = PurePosixPath(args.workflow)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        print(f"fleetrunner: {args.workflow!r} is not a folder under the claim", file=sys.stderr)
        return 2
    chained = args.chain is not None
    if chained and (
        not RUN_ID.match(args.chain) or args.index < 1 or not args.lease_holder or args.verify
    ):
        print("fleetrunner: a chain's step needs its run id, index and Lease", file=sys.stderr)
        return 2
    settings = BackendConfig.model_validate_json(os.environ[SETTINGS_ENV])
    settings = settings.model_copy(update={"node_name": os.environ[NODE_ENV]})
    # The controller's host settings the run honours (its durability, its recording).
    carried = Carried.model_validate_json(os.environ.get(CARRIED_ENV) or "{}")
    stopsignals.on_stop(signal.SIGTERM, RunInterrupted)
    api = connect(settings)
    pod = os.environ[POD_ENV]
    repeated = claim_job_start(api, settings.namespace, pod)
    if repeated is not None:
        print(f"{REFUSED_MARK}{repeated}", flush=True)
        api.close()
        return 3
    lease = WorkflowLease(
        api, settings.namespace, rel.as_posix(), args.lease_holder if chained else pod
    )
    try:
        lease.join() if chained else lease.acquire()
    except RefusedError as exc:
        print(f"{REFUSED_MARK}{exc}", flush=True)
        api.close()
        return 3
    core = client.CoreV1Api(api)
    announced: list[str] = []

    def announce(event: RunEvent) -> None:
        """The run's id on this Pod, at its first event: `sandbox gc` finds the record
        of a runner that died from it."""
        if announced:
            return
        announced.append(event.run_id)
        body = {"metadata": {"annotations": {ANNOTATION_RUN_ID: event.run_id}}}
        core.patch_namespaced_pod(pod, settings.namespace, body)

    workflow_dir = Path(RUNNER_CLAIM_ROOT) / rel
    options = RunOptions(
        on_event=announce, durability=carried.durability, recording=carried.recording
    )
    run = TestRun(workflow_dir, args.step_id, options, lambda: connect_backend(settings))
    try:
        if chained:
            record = _chain_step(run, args, settings)
        elif args.verify:
            from sandbox.verify.verifystep import verify_step

            verification = verify_step(
                workflow_dir, args.step_id, options, backend=lambda: connect_backend(settings)
            )
            print(f"verified {verification.passed} on {settings.node_name}", flush=True)
            print(f"{RUN_ID_MARK}{verification.run_id}", flush=True)
            return 0
        else:
            record = run.execute()
    except SandboxError as exc:  # before the run's record exists: it did not start
        print(f"{REFUSED_MARK}{exc}", flush=True)
        return 3
    finally:
        lease.release()
        api.close()
    print(f"status {record.status.value} on {record.node}", flush=True)
    print(f"{RUN_ID_MARK}{record.id}", flush=True)
    return 0


def _chain_step(run: TestRun, args: Any, settings: BackendConfig) -> TestRunRecord:
    """One step of a chain, in the folder the controller made for it, under this
    node's file lock (the chain's Lease is joined)."""
    inputs = run.read_inputs()
    layout = WorkflowRunLayout(run.workflow_dir, args.chain).step(
        args.index, args.step_id, inputs.step.group
    )
    root = layout.root
    if root.is_symlink() or not root.is_dir() or os.path.lexists(layout.record):
        raise RefusedError(f"{root}: not the chain's fresh folder for step {args.index}")
    real = Seed.from_workflow(run.workflow_dir, inputs.step.group)
    chain_root = WorkflowRunLayout(run.workflow_dir, args.chain).steps_dir
    seed = Seed(
        group=_seed(run.workflow_dir, args.seed_group, real.group, chain_root),
        db=_seed(run.workflow_dir, args.seed_db, real.db, chain_root),
    )
    owner = f"sandbox workflow test run {args.chain} (step {args.index}, fleet)"
    with (
        workflow_run_lock(run.workflow_dir, exclusive=True, owner=owner),
        contextlib.closing(connect_backend(settings)) as backend,
    ):
        record = run.new_record(backend, inputs, layout, workflow_run_id=args.chain)
        return run.run_held(backend, inputs, layout, record, seed)


def _seed(workflow_dir: Path, spec: str, real: Path | None, chain_steps: Path) -> Path | None:
    """What the controller named as a step's seed, only if it is what this runner finds
    itself: the real one (`real`), nothing (`-`), or a folder or file under the chain's
    steps (what an earlier step left), never through a link."""
    if spec == SEED_NONE:
        return None
    if spec == SEED_REAL:
        return real
    rel = PurePosixPath(spec)
    path = workflow_dir / rel
    if rel.is_absolute() or ".." in rel.parts or not path.is_relative_to(chain_steps):
        raise SandboxError(f"seed {spec!r}: not under the chain's steps")
    here = chain_steps
    for part in path.relative_to(chain_steps).parts:
        here = here / part
        if here.is_symlink():
            raise SandboxError(f"seed {spec!r}: a link")
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
