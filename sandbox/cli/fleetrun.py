"""`sandbox run` with `placement = "scheduler"`: the run submitted to the fleet.

This command is then the controller of docs/guides/fleet.md: it submits the run as a
Job (`FleetRun`), the cluster's scheduler places the runner's Pod, and the host-side
work happens on that node. The command waits, reads the record the runner sealed from
its own view of the shared claim, prints it and exits as any run does. `--follow`
prints what the controller sees: the node the run landed on and the runner Pod's
phases. A stop (Ctrl-C, SIGTERM) deletes the Job: the runner gets SIGTERM and seals
the record `killed`, which is read once the runner's Pod is gone (exit 130). Run
options the Job does not carry to the runner are refused, never dropped.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandbox.contracts.errors import ConfigError
from sandbox.launch.runtime import POD_RUNSC_REFUSAL

if TYPE_CHECKING:
    from sandbox.backends.kubernetes.fleet import FleetRun
    from sandbox.contracts.hostconfig import BackendConfig
    from sandbox.contracts.record import TestRunRecord
    from sandbox.progress import FollowPrinter

WAIT_CHUNK_S = 60.0  # one wait of the runner's Pod; the command waits as long as the run
# After the Job is deleted: the runner's grace period (its clean-up, the record
# sealed `killed`) and the Pod's deletion.
CANCEL_WAIT_EXTRA_S = 30.0

# What the runner's Job does not carry (it runs the step with the workflow's own
# settings): refused, so a run never runs with less than was asked.
NOT_ON_THE_FLEET = {
    "timeout": "--timeout",
    "upstream_bridge": "--upstream-bridge",
    "upstream_network": "--upstream-network",
    "allow_host": "--allow-host",
    "canary": "--canary",
    "step_runtime": "--step-runtime",
}


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


def run_on_fleet(
    args: argparse.Namespace, config: BackendConfig, printer: FollowPrinter | None
) -> TestRunRecord | None:
    """The record the runner sealed; None when a stop came before the runner named
    its run (at the run's first event): the Job is deleted and no record is known."""
    if getattr(args, "step_runtime", None) == "runsc":
        raise ConfigError(POD_RUNSC_REFUSAL)
    asked = [flag for name, flag in NOT_ON_THE_FLEET.items() if getattr(args, name, None)]
    if asked:
        raise ConfigError(
            f"{', '.join(asked)}: not carried to a run the scheduler places "
            "(placement = 'scheduler'); set it in the workflow, or run on this host"
        )
    from sandbox import stopsignals
    from sandbox.backends.choose import needs_client
    from sandbox.run.cancel import RunInterrupted

    with needs_client():
        from sandbox.backends.kubernetes.fleet import RUNNER_GRACE_S, FleetRun
    with stopsignals.held():  # a stop lands once the Job is ours to delete
        run = FleetRun.submit(config, Path(args.workflow_dir), args.step_id)
    try:
        on_event = None if printer is None else _events(run, args.step_id, printer)
        try:
            while not run.wait(WAIT_CHUNK_S, on_event):
                pass
        except (KeyboardInterrupt, RunInterrupted):
            run.cancel()
            run.wait(RUNNER_GRACE_S + CANCEL_WAIT_EXTRA_S, on_event)
            if run.run_id is None:
                return None
        return run.record()
    finally:
        run.delete()
        run.close()


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
