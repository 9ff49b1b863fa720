"""The Kubernetes backend as the run's phases use it: start, wait, collect, remove.

What the run prepares on the host (the run folder, the step's disk, the workflow view,
the action log) is the same as on Docker; this backend puts the containers in one Pod
on the cluster (`pod`), drives it (`podrun`), and hands back what the record needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sandbox.contracts.errors import ConfigError
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.record import OutputTail
from sandbox.launch import specs as launch
from sandbox.launch.specs import RunPlan

from . import pod as manifests
from . import podrun

GUARD_STOP_DEADLINE_S = 30.0


@dataclass
class StepOutcome:
    """What the Pod said at the step's end, before it was removed."""

    guard_running: bool
    guard_exit: int | None
    oom: bool
    output: OutputTail  # stdout and stderr as one log (the Pod API merges them)
    guard_log: OutputTail
    node: str | None


class KubernetesBackend:
    """One cluster connection for one run (closed with it)."""

    def __init__(self, settings: BackendConfig) -> None:
        if settings.storage == "pvc":
            raise ConfigError(
                "storage = 'pvc' is not available for runs yet: the step's disk and the "
                "workflow view are mounts on the runner's host, which another node's "
                "claim does not show"
            )
        self.settings = settings
        self.api: Any = podrun.connect(settings)

    def close(self) -> None:
        self.api.close()

    def image(self, reference: str) -> str:
        """The image reference the nodes run (the record names it)."""
        return self.settings.image_prefix + reference

    def start(self, plan: RunPlan) -> podrun.PodRun:
        """The Pod created, its firewall in and read back, its step running (or ended)."""
        pod = manifests.pod_manifest(plan, self.settings)
        secret = manifests.secret_manifest(
            plan, self.settings, launch.guard_config(plan).model_dump_json()
        )
        run = podrun.PodRun.create(self.api, pod, secret)
        run.await_step_start(install_firewall=plan.install_firewall)
        return run

    def wait(self, run: podrun.PodRun, timeout_s: float) -> int | None:
        """The step's exit code, None on timeout; a guard that ends first kills it."""
        return run.await_step_end(timeout_s, on_guard_end=lambda: None)

    def collect(self, run: podrun.PodRun) -> StepOutcome:
        """Stop the guard (no call is in flight once it is gone), then read the logs."""
        view = run.view
        guard_running, guard_exit = view.guard_running, view.guard_exit
        oom = view.step_reason == "OOMKilled"
        run.kill()
        run.follow(
            lambda v: (not v.guard_running and v.guard_exit is not None) or v.over,
            time.monotonic() + GUARD_STOP_DEADLINE_S,
        )
        return StepOutcome(
            guard_running=guard_running,
            guard_exit=guard_exit,
            oom=oom,
            output=run.log_tail(manifests.STEP),
            guard_log=run.log_tail(manifests.GUARD),
            node=view.node_name,
        )

    def remove(self, run: podrun.PodRun) -> None:
        run.delete()
