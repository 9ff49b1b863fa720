"""The run's plan: everything its containers and folders depend on, resolved before any
of them exists (`RunPlan`), and the walls it is built with (`Walls`).

Pure apart from reading the host config and making the run's TLS-inspection CA: the
plan is data that the prepare phase fills folders from and that `sandbox.launch.specs`
turns into containers.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from sandbox.contracts import names
from sandbox.contracts.config import Egress, EgressEntry, McpServer, Step, StepRuntime, Workflow
from sandbox.contracts.hostconfig import DEFAULT_DURABILITY, Durability, load_host_config
from sandbox.contracts.ids import NO_REMAP, IdMap
from sandbox.contracts.layout import STEP_UID, RunLayout
from sandbox.contracts.options import RunOptions
from sandbox.contracts.record import RunnerInfo, Walls
from sandbox.contracts.recording import RecordingSettings
from sandbox.contracts.settings import RunnerSettings, runner_settings
from sandbox.contracts.testknobs import current as test_knobs
from sandbox.prepare.inputs import StepInputs
from sandbox.prepare.replaysource import ReplaySource, find_source


@dataclass(frozen=True)
class Tokens:
    """Per-run secrets: the step's bridge token and the guard's executor token."""

    bridge: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    exec: str = field(default_factory=lambda: secrets.token_urlsafe(24))


@dataclass(frozen=True)
class EgressCA:
    """The run's TLS-inspection CA as PEM text (made by the runner; see `egress.tls`)."""

    cert_pem: str
    key_pem: str = field(repr=False)


@dataclass(frozen=True)
class RunPlan:
    """Everything the specs depend on, resolved before any container exists."""

    workflow_dir: Path
    workflow: Workflow
    step: Step
    layout: RunLayout
    runner: RunnerInfo
    crew: dict[str, Path]
    has_db: bool
    has_prompt: bool
    seccomp_profile: str
    upstream: str | None
    networks: list[str]
    egress: Egress
    trusted_ca_pem: str
    mcp_host_env: dict[str, dict[str, str]]
    canary: str | None = None
    canary6: str | None = None
    install_firewall: bool = True
    durability: Durability = DEFAULT_DURABILITY  # the action log's (host.toml)
    tokens: Tokens = field(default_factory=Tokens)
    egress_ca: EgressCA | None = None  # set when some allow-list entry is inspected
    ids: IdMap = NO_REMAP  # the engine's remapping: what host ids the runner chowns to
    step_runtime: StepRuntime = "runc"  # runsc: the step under gVisor (see launch.runtime)
    # The test run the step belongs to: a whole-workflow run's id for each step of a
    # chain, else the step's own run id ("": the step's own).
    test_run_id: str = ""
    # Every allowed read's answer kept (its caps), and the run whose recording this
    # run's reads are answered from (None: a live run).
    recording: RecordingSettings = field(default_factory=RecordingSettings)
    replay_from: ReplaySource | None = None


def step_runtime_for(
    workflow: Workflow, asked: StepRuntime | None, settings: RunnerSettings | None = None
) -> StepRuntime:
    """runsc when the workflow (`[isolation] step_runtime`), the run's options or
    `SANDBOX_STEP_RUNTIME` asks for it: any of them can add the wall, none can take
    away one the workflow asked for. An unknown value in the environment is an error."""
    from_env = (settings or runner_settings()).step_runtime()
    wanted = {workflow.isolation.step_runtime, asked, from_env}
    return "runsc" if "runsc" in wanted else "runc"


def egress_for_run(workflow: Workflow, extra_hosts: tuple[str, ...]) -> Egress:
    """The workflow's allow list plus the hosts added for this run only."""
    extra = [EgressEntry(host=host) for host in extra_hosts]
    return workflow.egress.model_copy(update={"allow": [*workflow.egress.allow, *extra]})


def stdio_servers(workflow: Workflow) -> list[tuple[int, McpServer]]:
    """The workflow's stdio MCP servers with their index (which names their uid)."""
    return [(i, s) for i, s in enumerate(workflow.mcp_servers) if s.command is not None]


def images_of(workflow: Workflow) -> dict[str, str]:
    """The project images a run of the workflow uses, by role (what its version hash
    names): the step's, and the MCP servers' when it has stdio servers."""
    wanted = {"step": names.STEP_IMAGE}
    if stdio_servers(workflow):
        wanted["mcp"] = names.MCP_IMAGE
    return wanted


def needs_egress_ca(workflow: Workflow, egress: Egress) -> bool:
    """Whether the run needs its TLS-inspection CA: the step's list (`egress`) or a
    stdio server's own list has an entry whose TLS the guard opens."""
    return egress.needs_ca() or any(
        server.own_egress().needs_ca() for _, server in stdio_servers(workflow)
    )


def step_user() -> tuple[int, int]:
    """A root runner hands the step a fixed unprivileged uid; others run it as themselves."""
    if os.geteuid() == 0:
        return STEP_UID, STEP_UID
    return os.getuid(), os.getgid()


def make_egress_ca(run_id: str) -> EgressCA:
    """This run's TLS-inspection CA (about a millisecond; see sandbox.guard.egress.tls). Its
    module, and the X.509 library under it, load only for a run that inspects TLS."""
    from sandbox.guard.egress.tls import RunCA

    ca = RunCA.new(run_id)
    return EgressCA(cert_pem=ca.cert_pem().decode("ascii"), key_pem=ca.key_pem().decode("ascii"))


def walls_for(
    options: RunOptions, inputs: StepInputs, step_runtime: StepRuntime, ids: IdMap
) -> Walls:
    """The walls the run is built with (`full` and `lacking` are judged at collect)."""
    return Walls(
        step_runtime=step_runtime,
        userns_remap=ids.remapped,
        host_uid_base=ids.uid_base if ids.remapped else None,
        firewall=test_knobs().install_firewall,  # else the launch fails on its readback
        seccomp=bool(inputs.seccomp_text),
        egress_additions=list(options.allow_hosts),
        upstream_overrides=[
            *([f"bridge upstream {options.upstream_bridge}"] if options.upstream_bridge else []),
            *(f"network {n}" for n in options.upstream_networks),
        ],
    )


def plan_run(
    workflow_dir: Path,
    options: RunOptions,
    inputs: StepInputs,
    layout: RunLayout,
    runner: RunnerInfo,
    *,
    has_db: bool,
    ids: IdMap = NO_REMAP,
    step_runtime: StepRuntime = "runc",
    test_run_id: str = "",
) -> RunPlan:
    """The plan of one step's run from what was read and what the caller asked."""
    workflow = inputs.workflow
    egress = egress_for_run(workflow, options.allow_hosts)
    knobs = test_knobs()
    host = load_host_config()
    replay_from = (
        find_source(workflow_dir, options.replay, options.replay_miss) if options.replay else None
    )
    return RunPlan(
        workflow_dir=workflow_dir,
        workflow=workflow,
        step=inputs.step,
        layout=layout,
        runner=runner,
        crew=inputs.crew,
        has_db=has_db,
        has_prompt=inputs.prompt is not None,
        seccomp_profile=inputs.seccomp_text,
        upstream=options.upstream_bridge or workflow.bridge.upstream,
        networks=[*workflow.bridge.networks, *options.upstream_networks],
        egress=egress,
        egress_ca=(make_egress_ca(layout.run_id) if needs_egress_ca(workflow, egress) else None),
        trusted_ca_pem=inputs.trusted_ca_pem,
        mcp_host_env=inputs.mcp_host_env,
        canary=options.canary,
        canary6=options.canary6,
        install_firewall=knobs.install_firewall,
        durability=options.durability or host.durability,
        ids=ids,
        step_runtime=step_runtime,
        test_run_id=test_run_id,
        recording=options.recording or host.recording,
        replay_from=replay_from,
    )
