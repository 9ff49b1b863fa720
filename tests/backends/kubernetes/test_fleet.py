"""How a fleet runner ended, as the controller tells it from its Pod's last state
(`FleetRun.how_it_ended`): a run it left no record of ends `killed` when the runner
was killed or lost its Pod, else `error` with the code it exited with (the chain's
case on a cluster: tests/kubernetes/test_fleet_chain.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client

from sandbox.backends.kubernetes.fleet import FleetRun
from sandbox.contracts.hostconfig import BackendConfig


def _run(pod: client.V1Pod | None, *, deleted: bool = False) -> FleetRun:
    settings = BackendConfig(kind="kubernetes", namespace="runs")
    run = FleetRun(client.ApiClient(), settings, Path("/claim/wf"), "sandbox-run-0")
    run.ended, run.ended_deleted = pod, deleted
    return run


def _pod(phase: str, terminated: client.V1ContainerStateTerminated | None) -> client.V1Pod:
    state = client.V1ContainerState(terminated=terminated)
    status = client.V1ContainerStatus(
        name="runner", image="r", image_id="", ready=False, restart_count=0, state=state
    )
    return client.V1Pod(status=client.V1PodStatus(phase=phase, container_statuses=[status]))


@pytest.mark.parametrize(
    ("code", "reason", "killed", "said"),
    [
        (137, "Error", True, "was killed (Error, exit code 137)"),
        (137, "OOMKilled", True, "was killed (OOMKilled, exit code 137)"),
        (1, "Error", False, "exited with code 1 (Error)"),
        (0, "Completed", False, "exited with code 0 (Completed)"),
    ],
)
def test_a_runner_container_that_ended_is_killed_only_by_a_signal_or_oom(
    code: int, reason: str, killed: bool, said: str
) -> None:
    ended = client.V1ContainerStateTerminated(exit_code=code, reason=reason)
    assert _run(_pod("Failed", ended)).how_it_ended() == (killed, said)


def test_a_runner_whose_pod_went_before_its_container_ended_was_killed() -> None:
    lost = "lost its Pod (deleted or evicted) before it ended"
    assert _run(_pod("Pending", None), deleted=True).how_it_ended() == (True, lost)
    assert _run(None, deleted=True).how_it_ended() == (True, lost)
    evicted = client.V1Pod(status=client.V1PodStatus(phase="Failed", reason="Evicted"))
    assert _run(evicted).how_it_ended() == (True, "ended Failed (Evicted)")
