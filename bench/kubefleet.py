"""Start-up of a run the scheduler places (`placement = "scheduler"`), for
`bench/kubernetes.py`: from `FleetRun.submit` of a no-op step to its record read from
the claim, against a bare `true` Pod created and watched to its container's end.

The fleet's run is the controller's whole wait: the Job made, the scheduler placing
the runner's Pod, the runner's start (its image, its Python), its host-side work on the
node (the lock's Lease, the step's disk, the workflow view, the DB copy), the run's own
Pod (firewall, guard, step), collect and the record sealed on the claim, then read.

On the local test cluster the bench installs what an operator would (the runner image,
its RBAC, a ReadWriteMany claim both nodes mount: `testbed/kubernetes/fleetsetup.py`);
on the host config's cluster it needs `placement = "scheduler"` there, else the row
says it was not measured.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import BenchError, write_workflow
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.record import RunStatus

RUN_DEADLINE_S = 300.0
GONE_DEADLINE_S = 120.0


@dataclass
class Fleet:
    """How to submit a run to the fleet: its settings, and what the runner's Pod needs
    to reach the API server on the local cluster."""

    settings: BackendConfig
    env: dict[str, str] | None = None
    host_network: bool = False
    nodes: set[str] = field(default_factory=set)


@contextlib.contextmanager
def local_fleet(cluster: Any, api: Any, namespace: str, profile: str) -> Iterator[Fleet]:
    """The local cluster set up for the scheduler placement, in `namespace`, the step's
    seccomp profile installed on its nodes as `profile`."""
    from kubernetes import client

    from testbed.kubernetes.fleetsetup import (
        apply_runner_role,
        build_runner_image,
        hostpath_claim,
        local_api_env,
    )

    image = build_runner_image(cluster)
    apply_runner_role(api, namespace)
    with hostpath_claim(cluster, client.CoreV1Api(api), namespace) as (claim, root):
        yield Fleet(
            BackendConfig.preloaded_cluster(
                cluster.kubeconfig, namespace, profile, claim=(claim, root), runner_image=image
            ),
            env=local_api_env(cluster),
            host_network=True,
        )


def noop_workflow(fleet: Fleet, name: str) -> Path:
    """A no-op workflow on the claim, where the runner's Pod sees it."""
    root = fleet.settings.claim_root
    if root is None:
        raise BenchError("the scheduler placement needs claim_root")
    return write_workflow(Path(root) / name, name="noop", step="noop", command=["true"])


def fleet_run_s(core: Any, fleet: Fleet, workflow: Path) -> float:
    """Submitted, placed, run, its record read from the claim: seconds. Then (not timed)
    the Job and its runner's Pod deleted and gone."""
    from sandbox.backends.kubernetes.fleet import LABEL_JOB, FleetRun

    started = time.perf_counter()
    run = FleetRun.submit(
        fleet.settings, workflow, "noop", env=fleet.env, host_network=fleet.host_network
    )
    try:
        if not run.wait(RUN_DEADLINE_S):
            raise BenchError(f"the fleet's no-op run did not end within {RUN_DEADLINE_S:.0f} s")
        record = run.record()
        elapsed = time.perf_counter() - started
        if record.status is not RunStatus.PASSED:
            raise BenchError(f"the fleet's no-op run ended {record.status.value}: {record.reason}")
        if run.node:
            fleet.nodes.add(run.node)
    finally:
        run.delete()
        run.close()
    namespace, selector = fleet.settings.namespace, f"{LABEL_JOB}={run.name}"
    deadline = time.monotonic() + GONE_DEADLINE_S
    while core.list_namespaced_pod(namespace, label_selector=selector).items:
        if time.monotonic() > deadline:
            raise BenchError(f"the runner's Pod of {run.name} outlived its Job")
        time.sleep(0.1)
    return elapsed
