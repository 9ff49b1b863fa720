"""A chain the cluster's scheduler places: each step a runner Job, on any node.

`FleetWorkflowRun` is `WorkflowRun` with its one difference, where a step runs: the
controller (this process, anywhere that reaches the API server and sees the claim)
sequences the chain exactly as on one host (one `runs/test-<id>/` on the claim, its
record from the start, the DB copy and group folders carried step to step, the
chain's action log, the verdict, the DB diff at the end), and submits each step as a
runner Job (`FleetRun`, the one `sandbox run` submits) that the scheduler places on
any node. The step's runner (`fleetrunner --chain`) runs it in the step's folder
under the chain's folder on the claim, seeded from what the earlier steps left there:
a step on another node sees what the step before it wrote, because the state lives
on the claim, never on a node. The spec: `fleetchain.spec.md`.

The workflow's exclusion is the fleet's: the chain's Lease, held by this controller
from the first step to the last, joined by each step's runner while its step runs.
A stop (SIGTERM, Ctrl-C, `cancel()`) deletes the running step's Job: its runner
records the step `killed`, and so the chain. A step's runner killed outright (its
Pod ended, the step's record unsealed) ends the chain `killed`, its Job left for
`sandbox gc`, which records the step `killed` and removes what the runner left. A
step's runner that ended before it began the step's record (the step did not run,
nothing of it exists) ends the chain `killed` (killed, its Pod deleted) or `error`
(it exited), its last log lines in the reason, its Job deleted. A
controller killed outright leaves the chain's marker beside its Lease, by which
`sandbox gc` records the chain `killed` once the controller is provably gone
(`fleetgc`). Each step's Job carries the
controller's `durability` and `[recording]` (`fleet.Carried`); run options a runner
Job does not carry are refused, never dropped.
"""

from __future__ import annotations

import contextlib
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from sandbox.contracts.config import load_workflow
from sandbox.contracts.errors import ConfigError, EngineError, RefusedError
from sandbox.contracts.events import RunEvent
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.layout import WorkflowRunLayout
from sandbox.contracts.record import RunStatus, TestRunRecord, read_record
from sandbox.contracts.workflow_record import WorkflowRunRecord
from sandbox.run.cancel import RunInterrupted
from sandbox.run.testrun import Seed
from sandbox.run.workflowrun import (
    StepPlace,
    StepStarted,
    WorkflowOptions,
    WorkflowRun,
    chain_of,
)

if TYPE_CHECKING:
    from sandbox.backends.kubernetes.fleet import FleetRun

WAIT_CHUNK_S = 5.0  # one wait of a step's runner; a `cancel()` is seen between two
CANCEL_WAIT_EXTRA_S = 30.0  # after the runner's grace period: its Pod's deletion


class StepRunnerDied(RunInterrupted):
    """A step's runner ended without sealing its record, or killed before it began
    it: the chain ends `killed`."""


class FleetWorkflowRun(WorkflowRun):
    """A workflow's steps, once, as one test run, each step placed by the scheduler.

    `api`, `env` and `host_network` go to each step's `FleetRun.submit` (the last two
    for clusters whose Pods reach the API server only through their node)."""

    def __init__(
        self,
        settings: BackendConfig,
        workflow_dir: Path,
        options: WorkflowOptions | None = None,
        *,
        api: Any = None,
        env: dict[str, str] | None = None,
        host_network: bool = False,
    ) -> None:
        super().__init__(workflow_dir, options)
        from sandbox.backends.kubernetes.fleet import Carried, claim_path, refuse_not_carried

        if settings.kind != "kubernetes" or settings.placement != "scheduler":
            raise ConfigError(
                "a chain on the fleet needs kind = 'kubernetes' and placement = 'scheduler'"
            )
        refuse_not_carried(self.options.step)
        # Each step's runner honours these as a one-host step honours its host's.
        self.carried = Carried.of(self.options.step)
        self.settings = settings
        self.claim_workflow = claim_path(settings, self.workflow_dir)
        self._api, self._env, self._host_network = api, env, host_network
        from sandbox.backends.kubernetes.lease import chain_holder

        # The chain's Lease holder: this controller, and each step's runner with it.
        self.holder = chain_holder()
        self.current: FleetRun | None = None  # the step's Job while it runs

    def execute(self) -> WorkflowRunRecord:
        """Run the chain. Raises SandboxError only before a run folder exists. The
        controller reads the workflow's config only: each step's inputs (its prompt,
        its MCP servers' credentials) are read by its runner, where the step runs."""
        if self.options.step.replay is not None:
            raise ConfigError("a workflow run does not replay")
        workflow = load_workflow(self.workflow_dir)
        chain = chain_of(workflow, self.options.from_step, self.options.to_step)
        from sandbox.backends.kubernetes.podrun import connect

        own_api = self._api is None
        api = connect(self.settings) if own_api else self._api
        self._conn = api
        try:
            return self._execute(workflow, chain, self._run_step)
        finally:
            if own_api:
                with contextlib.suppress(Exception):
                    api.close()

    def _lock(self, layout: WorkflowRunLayout) -> contextlib.AbstractContextManager[object]:
        """The workflow's Lease, taken now (LeaseHeldError, a RefusedError, names a live
        holder) and released when the chain ends; with it the chain's marker, by which
        `sandbox gc` finds the chain if this controller dies (`fleetgc`)."""
        from sandbox.backends.kubernetes.lease import WorkflowLease, mark_chain, unmark_chain

        namespace = self.settings.namespace
        lease = WorkflowLease(self._conn, namespace, self.claim_workflow, self.holder)
        lease.acquire()
        try:
            mark_chain(self._conn, namespace, self.claim_workflow, self.holder, layout.run_id)
        except BaseException:
            lease.release()
            raise
        held = contextlib.ExitStack()
        held.callback(lease.release)
        # Run first (the chain's record is sealed by then), then the Lease released.
        held.callback(unmark_chain, self._conn, namespace, self.holder)
        return held

    def _run_step(self, place: StepPlace, seed: Seed, started: StepStarted) -> TestRunRecord:
        from sandbox import stopsignals
        from sandbox.backends.kubernetes.fleet import RUNNER_GRACE_S, FleetRun

        layout = WorkflowRunLayout(self.workflow_dir, place.chain_id)
        args = [
            "--chain",
            place.chain_id,
            "--index",
            str(place.index),
            "--seed-db",
            self._seed_spec(seed.db, layout),
            "--seed-group",
            self._seed_spec(seed.group, layout),
            "--lease-holder",
            self.holder,
        ]
        with stopsignals.held():  # a stop lands once the Job is ours to delete
            run = FleetRun.submit(
                self.settings,
                self.workflow_dir,
                place.step.id,
                api=self._conn,
                env=self._env,
                host_network=self._host_network,
                runner_args=args,
                carried=self.carried,
                chain_id=place.chain_id,
            )
        self.current = run
        started(place.layout.run_id, datetime.now(UTC))
        on_event = self._events(place)
        stopped = False
        runner_died = False  # its Job is left for `sandbox gc` (below)
        try:
            try:
                while not run.wait(WAIT_CHUNK_S, on_event):
                    self.stop.check()
            except (KeyboardInterrupt, RunInterrupted):
                stopped = True
                run.cancel()
                run.wait(RUNNER_GRACE_S + CANCEL_WAIT_EXTRA_S, on_event)
            if (stopped or self.stop.requested) and not os.path.lexists(place.layout.record):
                raise RunInterrupted()  # stopped before its runner began the step's record
            if run.refused is None and not os.path.lexists(place.layout.record):
                self._no_record(run, place)
            try:
                record = self._step_record(run, place)
            except EngineError:
                runner_died = run.refused is None
                raise
            if record.status is RunStatus.RUNNING and stopped:
                raise RunInterrupted()  # its runner outlived the grace period: still stopped
            if record.status is RunStatus.RUNNING:
                # Its runner's Pod ended and the step's record is unsealed: the runner
                # died (SIGKILL, OOM, its node lost) and cleaned up nothing. Its Job is
                # kept: by its ended Pod `sandbox gc` finds the dead runner, records the
                # step `killed` and removes the run's Pod, Secret and node mounts.
                runner_died = True
                raise StepRunnerDied(
                    f"the runner of step {place.step.id} died (Job {run.name}, node "
                    f"{run.node or 'none'}) before it sealed the step's record; "
                    "`sandbox gc` records the step and removes what it left"
                )
            return record
        finally:
            self.current = None
            if not runner_died:
                run.delete()

    @staticmethod
    def _no_record(run: FleetRun, place: StepPlace) -> NoReturn:
        """Its runner ended before it began the step's record: the step did not run.
        The record comes before anything of the step's run (its disk, Pod, Secret,
        mounts), so nothing of it is left for `sandbox gc`: the Job is deleted (with any
        Pod it would make again) and the reason keeps the runner's last lines, its log
        going with it. Killed (a signal, OOM, its Pod deleted or evicted): the chain
        ends `killed`; a runner that exited by itself: `error`."""
        killed, how = run.how_it_ended()
        why = (
            f"the runner of step {place.step.id} {how} before it began the step's record "
            f"(Job {run.name}, node {run.node or 'none'}): the step did not run"
        )
        if run.last_lines:
            why += f"; its last lines: {run.last_lines}"
        if killed:
            raise StepRunnerDied(why)
        raise EngineError(why)

    def cancel(self) -> None:
        super().cancel()
        run = self.current
        if run is not None:
            run.cancel()

    @staticmethod
    def _seed_spec(path: Path | None, layout: WorkflowRunLayout) -> str:
        """A seed as the step's runner checks it: under the chain's steps (what an
        earlier step left), else the real one the runner finds itself."""
        if path is None:
            return "-"
        if path.is_relative_to(layout.steps_dir):
            return path.relative_to(layout.workflow_dir).as_posix()
        return "real"

    def _step_record(self, run: FleetRun, place: StepPlace) -> TestRunRecord:
        """The step's record its runner sealed on the claim, in the step's folder."""
        if run.refused is not None:
            raise RefusedError(f"step {place.step.id}: {run.refused}")
        try:
            record = read_record(place.layout.root)
        except (OSError, ValueError):
            raise EngineError(
                f"step {place.step.id}: the runner of Job {run.name} left no record "
                f"(node {run.node or 'none'}; see its Pod's log)"
            ) from None
        if record.id != place.layout.run_id or record.workflow_run_id != place.chain_id:
            raise EngineError(f"step {place.step.id}: its folder holds another run's record")
        return record

    def _events(self, place: StepPlace) -> Any:
        """The step's runner's placement and phases as the chain's events."""
        callback = self.options.step.on_event
        if callback is None:
            return None

        def on_event(kind: str, fields: dict[str, Any]) -> None:
            event = RunEvent(
                kind="placed" if kind == "placed" else "runner",
                time=datetime.now(UTC),
                run_id=place.layout.run_id,
                step_id=place.step.id,
                index=place.index,
                total=place.total,
                node=str(fields.get("node") or ""),
                phase=str(fields.get("phase") or ""),
            )
            with contextlib.suppress(Exception):
                callback(event)

        return on_event
