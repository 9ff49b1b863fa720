"""`sandbox run`, `run-workflow` and `verify` with `placement = "scheduler"`: the fleet.

This command is then the controller of docs/guides/fleet.md: it submits the run as a
Job (`FleetRun`), the cluster's scheduler places the runner's Pod, and the host-side
work happens on that node. The command waits, reads what the runner sealed (the
record; with `verify`, the verification beside it) from its own view of the shared
claim, prints it and exits as any run does. `run-workflow` submits each step of the
chain as its own Job (`sandbox.run.fleetchain`), so each step lands wherever the
scheduler puts it. `--follow` prints what the controller sees: the node each run
landed on and its runner Pod's phases. A stop (Ctrl-C, SIGTERM) deletes the running
Job: the runner gets SIGTERM and seals the record `killed`, which is read once the
runner's Pod is gone (exit 130). The host config's `durability` and `[recording]` go
with the Job to the runner (`fleet.Carried`), as a one-host run honours them; run
options the Job does not carry to the runner are refused, never dropped.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandbox.contracts.errors import EngineError, RefusedError

if TYPE_CHECKING:
    from sandbox.backends.kubernetes.fleet import FleetRun
    from sandbox.contracts.hostconfig import BackendConfig
    from sandbox.contracts.options import RunOptions
    from sandbox.contracts.record import TestRunRecord
    from sandbox.contracts.workflow_record import WorkflowRunRecord
    from sandbox.progress import FollowPrinter
    from sandbox.verify.verification import Verification

WAIT_CHUNK_S = 60.0  # one wait of the runner's Pod; the command waits as long as the run
# After the Job is deleted: the runner's grace period (its clean-up, the record
# sealed `killed`) and the Pod's deletion.
CANCEL_WAIT_EXTRA_S = 30.0


def fleet_config(args: argparse.Namespace) -> BackendConfig | None:
    """The host's `[backend]` when it places runs with the scheduler (after
    `--backend`), else None: the run is this host's own."""
    from sandbox.contracts.hostconfig import load_host_config

    config = load_host_config(args.host_config).backend
    if args.backend is not None:
        config = config.model_copy(update={"kind": args.backend})
    if config.kind != "kubernetes" or config.placement != "scheduler":
        return None
    return config


def _host_settings(args: argparse.Namespace) -> RunOptions:
    """The controller's host settings a run honours (`durability`, `[recording]`), as
    `sandbox run` on one host reads them: the Job carries them to the runner."""
    from sandbox.contracts.hostconfig import load_host_config
    from sandbox.contracts.options import RunOptions

    host = load_host_config(args.host_config)
    return RunOptions(durability=host.durability, recording=host.recording)


def _refuse_not_carried(args: argparse.Namespace) -> None:
    """What the command was asked that a runner Job would drop: refused (ConfigError)."""
    from sandbox.backends.choose import needs_client
    from sandbox.contracts.options import RunOptions

    with needs_client():
        from sandbox.backends.kubernetes.fleet import refuse_not_carried
    refuse_not_carried(
        RunOptions(
            timeout_s=args.timeout,
            upstream_bridge=args.upstream_bridge,
            upstream_networks=tuple(args.upstream_network),
            allow_hosts=tuple(args.allow_host),
            canary=args.canary,
            step_runtime=args.step_runtime,
            replay=getattr(args, "replay", None),
        )
    )


def _submitted(
    args: argparse.Namespace,
    config: BackendConfig,
    printer: FollowPrinter | None,
    runner_args: list[str],
) -> FleetRun | None:
    """The run's Job submitted and waited for to its end (a stop deletes it and waits
    for the runner to seal its record); None when the stop came before the runner
    named its run. The caller deletes the Job."""
    _refuse_not_carried(args)
    from sandbox import stopsignals
    from sandbox.backends.choose import needs_client
    from sandbox.run.cancel import RunInterrupted

    with needs_client():
        from sandbox.backends.kubernetes.fleet import RUNNER_GRACE_S, Carried, FleetRun
    carried = Carried.of(_host_settings(args))
    with stopsignals.held():  # a stop lands once the Job is ours to delete
        run = FleetRun.submit(
            config, Path(args.workflow_dir), args.step_id, runner_args=runner_args, carried=carried
        )
    stopped = False
    try:
        on_event = None if printer is None else _events(run, args.step_id, printer)
        try:
            while not run.wait(WAIT_CHUNK_S, on_event):
                pass
        except (KeyboardInterrupt, RunInterrupted):
            stopped = True
            run.cancel()
            run.wait(RUNNER_GRACE_S + CANCEL_WAIT_EXTRA_S, on_event)
    except BaseException:
        run.delete()
        run.close()
        raise
    if stopped and run.run_id is None and run.refused is None:
        run.delete()
        run.close()
        return None
    return run


def run_on_fleet(
    args: argparse.Namespace, config: BackendConfig, printer: FollowPrinter | None
) -> TestRunRecord | None:
    """The record the runner sealed; None when a stop came before the runner named
    its run (at the run's first event): the Job is deleted and no record is known."""
    run = _submitted(args, config, printer, [])
    if run is None:
        return None
    try:
        return run.record()
    finally:
        run.delete()
        run.close()


def verify_on_fleet(
    args: argparse.Namespace, config: BackendConfig, printer: FollowPrinter | None
) -> Verification | None:
    """The verification the runner judged and wrote beside the run's record on the
    claim (and into the workflow's history there, which `sandbox gate` reads); None
    as for `run_on_fleet`. A run whose runner left no verification is not verified:
    an error says why."""
    # The expectations parse before anything runs, as on one host (a typo is a
    # ConfigError): the runner reads them again where it judges the run.
    from sandbox.contracts.config import load_workflow
    from sandbox.verify.expect import load_expectations

    _refuse_not_carried(args)
    wf_dir = Path(args.workflow_dir)
    workflow = load_workflow(wf_dir)
    load_expectations(wf_dir, workflow, workflow.step(args.step_id))
    run = _submitted(args, config, printer, ["--verify"])
    if run is None:
        return None
    try:
        if run.refused is not None:
            raise RefusedError(run.refused)
        from sandbox.verify.finished import FinishedStep

        if run.run_id is None:
            raise EngineError(f"the runner of Job {run.name} named no run (see its Pod's log)")
        finished = FinishedStep.load(run.workflow_dir / "runs" / run.run_id)
        verification = finished.verification
        if verification is None or verification.run_id != run.run_id:
            why = finished.verification_error or "no verification was written"
            raise EngineError(
                f"not verified: run {run.run_id} ({finished.record.status.value}) on node "
                f"{run.node or '?'}: {why}"
            )
        return verification
    finally:
        run.delete()
        run.close()


def chain_on_fleet(
    args: argparse.Namespace, config: BackendConfig, printer: FollowPrinter | None
) -> WorkflowRunRecord:
    """The chain, each step submitted as its own Job (`FleetWorkflowRun`)."""
    _refuse_not_carried(args)
    import dataclasses

    from sandbox.backends.choose import needs_client
    from sandbox.run.workflowrun import WorkflowOptions

    with needs_client():
        from sandbox.run.fleetchain import FleetWorkflowRun

        options = WorkflowOptions(
            from_step=args.from_step,
            to_step=args.to_step,
            keep_going=args.keep_going,
            step=dataclasses.replace(_host_settings(args), on_event=printer),
        )
        chain = FleetWorkflowRun(config, Path(args.workflow_dir), options)
    return chain.execute()


def _events(run: FleetRun, step_id: str, printer: FollowPrinter) -> Any:
    """`FleetRun.wait`'s reports as the `RunEvent`s `--follow` prints."""
    from sandbox.contracts.events import RunEvent

    def on_event(kind: str, fields: dict[str, Any]) -> None:
        printer(
            RunEvent(
                kind="placed" if kind == "placed" else "runner",
                time=datetime.now(UTC),
                run_id=run.run_id or "",
                step_id=step_id,
                node=str(fields.get("node") or ""),
                phase=str(fields.get("phase") or ""),
            )
        )

    return on_event
