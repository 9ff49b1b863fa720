"""What a caller may ask of one test run beyond its workflow: `RunOptions`.

Every phase reads these (the plan, the guard phase's timeout and live progress), so
they sit below all of them; `sandbox.run.testrun` re-exports them as the public name.
Nothing here can take a wall away (the knobs the project's own tests use for that are
in `sandbox.contracts.testknobs`); what widens a run (hosts, upstream networks) is
written into its record's walls, and the gate refuses such a run.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbox.contracts.config import StepRuntime
from sandbox.contracts.events import EventCallback
from sandbox.contracts.hostconfig import Durability
from sandbox.contracts.recording import MissMode, RecordingSettings


@dataclass(frozen=True)
class RunOptions:
    """One run's options; the defaults are a plain run of the workflow as written."""

    timeout_s: float | None = None
    upstream_bridge: str | None = None
    upstream_networks: tuple[str, ...] = ()
    allow_hosts: tuple[str, ...] = ()  # egress allow-list additions for this run only
    # Addresses ("host:port") the preflight must find unreachable from the step.
    canary: str | None = None
    canary6: str | None = None
    # How the guard syncs the action log: "group" (group commit, the runner syncs at
    # the seal) or "per-call" (each line synced before its call goes on). None: what
    # the host's config says (`durability` in host.toml; "group" without one).
    durability: Durability | None = None
    # Live progress (`--follow`): the step's start and end, and each guarded call as
    # the guard logs it. Called on the runner's threads; what it raises is ignored.
    on_event: EventCallback | None = None
    # "runsc": the step under gVisor (`--step-runtime`); see `step_runtime_for`.
    step_runtime: StepRuntime | None = None
    # Replay (`--replay RUN`): the step's reads answered from RUN's recording (a run
    # folder, or a run id under the workflow's runs/); `replay_miss` what a read the
    # recording lacks gets: "stub" (a TEST MODE replay-miss answer) or "live".
    replay: str | None = None
    replay_miss: MissMode = "stub"
    # The recording's caps for this run; None: what the host's config says.
    recording: RecordingSettings | None = None
