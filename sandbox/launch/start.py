"""The run's containers started through its backend: the MCP servers', the guard's with
its firewall in and read back exactly, then the step's.

The only engine calls of the launch phase; what each container is comes from
`sandbox.launch.specs`. A launch that fails leaves nothing the backend does not hold,
and `discard_unstarted` takes away what a run that never started its step made.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from dataclasses import dataclass

from sandbox.backends import Backend, RunContainer
from sandbox.contracts.config import McpServer
from sandbox.contracts.errors import LaunchError
from sandbox.contracts.layout import RunLayout
from sandbox.contracts.record import TestRunRecord
from sandbox.launch import firewall
from sandbox.launch import specs as launch
from sandbox.prepare.plan import RunPlan
from sandbox.prepare.rundir import Prepared, write_guard_config
from sandbox.stepfs import lifecycle as stepfs
from sandbox.stopsignals import HeldPool

GUARD_START_DEADLINE_S = 60.0

McpJobs = dict[str, concurrent.futures.Future[RunContainer]]
# The step's side of the prepare (`sandbox.prepare.rundir.prepare_step`) under way,
# with the seconds it took.
Preparing = concurrent.futures.Future[tuple[Prepared, float]]


@dataclass(frozen=True)
class Launched:
    """The run's containers, all started: the guard's firewall is in."""

    guard: RunContainer
    step: RunContainer
    mcp: dict[str, RunContainer]


def start_mcp_servers(
    backend: Backend,
    plan: RunPlan,
    pool: concurrent.futures.ThreadPoolExecutor,
    jobs: McpJobs,
    prepared: Preparing,
) -> None:
    """Each stdio server's container created and started in `pool` once the step's side
    is prepared (the servers mount the workflow's view and trust the run's CA bundle),
    its job in `jobs` (the run waits for them only once the step runs)."""
    for index, server in launch.stdio_servers(plan.workflow):
        jobs[server.name] = pool.submit(start_mcp, backend, plan, index, server, prepared)


def started_mcp(jobs: McpJobs) -> dict[str, RunContainer]:
    """The servers' containers, once every one of them started."""
    return {name: job.result() for name, job in jobs.items()}


def start_mcp(
    backend: Backend, plan: RunPlan, index: int, server: McpServer, prepared: Preparing
) -> RunContainer:
    prepared.result()
    container = backend.create(launch.mcp_server_spec(plan, index, server), independent=True)
    container.start()
    return container


def start_guard(
    backend: Backend, plan: RunPlan, prepared: Preparing
) -> tuple[RunContainer, RunContainer, tuple[Prepared, float]]:
    """The guard up with its firewall in and read back right, and the step's
    container started once `prepared` (the step's disk, view and copies: made in
    another thread while the engine creates and starts the guard's container, which
    mounts none of them) is done.

    The step is created beside the guard's start and started as soon as the guard's
    container runs (it joins its network namespace), so the firewall's install, the
    guard's start-up and the step container's start overlap. The step command itself
    waits: the executor starts it only once the guard listens, and the guard's entry
    script starts the guard only after the rules are in and read back exactly as
    expected (`firewall.guard_entry_script`); the runner checks the same readback
    here too, and a run whose firewall failed never gets past this phase. The step's
    CA bundle (with TLS inspection) holds the CA the runner made, so nothing waits
    for the guard. (The MCP servers' containers start beside all of it; each relay
    waits for its socket.)"""
    write_guard_config(plan.layout, launch.guard_config(plan), plan.ids)
    guard = backend.create(launch.guard_spec(plan))
    backend.connect_networks(guard, plan.networks[1:])
    spec = launch.step_spec(plan, guard.id, has_ca_bundle=plan.egress_ca is not None)

    # Leaving the pool waits for the creation on every way out, so an interrupted
    # launch never leaves a container that the backend does not hold (HeldPool: a
    # stop cannot land between the pool starting its thread and counting it).
    def create_step() -> tuple[RunContainer, tuple[Prepared, float]]:
        ready = prepared.result()  # the step's mounts exist
        return backend.create(spec), ready

    with HeldPool(max_workers=1) as pool:
        early_step = pool.submit(create_step)
        with guard.follow_output(deadline_s=GUARD_START_DEADLINE_S) as output:
            guard.start()
            step, ready = early_step.result()
            try:
                step.start()
            except Exception:
                # A guard whose firewall failed is gone: the step cannot join it.
                if not output.wait_for_line(firewall.READY_MARK):
                    raise LaunchError(
                        f"the run's firewall did not come up: {output.tail()}"
                    ) from None
                raise
            if not output.wait_for_line(firewall.READY_MARK):
                raise LaunchError(f"the run's firewall did not come up: {output.tail()}")
            # The guard's entry script printed the rules back; they must be exactly ours.
            installed = firewall.installed_rules(output.lines())
            # One Pod shares its namespace: the per-uid rules of its peers too.
            peers = launch.pod_peers(plan) if backend.kind == "kubernetes" else None
            if plan.install_firewall and installed != firewall.expected_readback(peers):
                raise LaunchError(f"the run's firewall reads back wrong: {' | '.join(installed)}")
    return guard, step, ready


def discard_unstarted(layout: RunLayout, record: TestRunRecord) -> None:
    """Leave only the record: nothing half-made survives a failed prepare or launch
    (fd-based, any depth: whatever the guard left in its folders is deleted too).
    The servers' stderr files stay when the record names them. Runs after the
    containers that mounted any of it are gone."""
    said = any(report.stderr_file for report in record.mcp_servers.values())
    with contextlib.suppress(Exception):
        stepfs.discard(
            [
                layout.group_dir,
                layout.db_dir,
                layout.baseline_db.parent,
                layout.prompt,
                layout.guard_dir,
                layout.mcp_dir,
                *([] if said else [layout.mcp_stderr_dir]),
            ]
        )
