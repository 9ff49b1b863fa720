"""The chain on the fleet from Python, where no cluster is needed: what a runner Job
would drop is refused before anything runs, and each step's seeds are named as its
runner checks them (runs through the fleet: tests/kubernetes/test_fleet_chain.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.contracts.errors import ConfigError
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.layout import WorkflowRunLayout
from sandbox.run.fleetchain import FleetWorkflowRun
from sandbox.run.testrun import RunOptions
from sandbox.run.workflowrun import WorkflowOptions
from tests.conftest import write_workflow


def _settings(root: Path) -> BackendConfig:
    return BackendConfig(
        kind="kubernetes",
        kubeconfig=str(root / "no-such.kubeconfig"),
        placement="scheduler",
        storage="pvc",
        claim="workflows",
        claim_root=str(root),
        runner_image="sandbox-runner:none",
    )


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        (RunOptions(timeout_s=5), "--timeout"),
        (RunOptions(allow_hosts=("example.org",)), "--allow-host"),
        (RunOptions(upstream_networks=("net",)), "--upstream-network"),
        (RunOptions(step_runtime="runc"), "--step-runtime"),
        (RunOptions(step_runtime="runsc"), "gVisor"),
    ],
)
def test_options_a_runner_job_drops_are_refused(
    tmp_path: Path, options: RunOptions, flag: str
) -> None:
    wf = write_workflow(tmp_path)
    with pytest.raises(ConfigError, match=flag):
        FleetWorkflowRun(_settings(tmp_path), wf, WorkflowOptions(step=options))
    assert not (wf / "runs").exists()


def test_a_workflow_outside_the_claim_is_refused(tmp_path: Path) -> None:
    wf = write_workflow(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="claim_root"):
        FleetWorkflowRun(_settings(tmp_path / "claim"), wf)


def test_a_seed_is_named_as_the_runner_checks_it(tmp_path: Path) -> None:
    layout = WorkflowRunLayout(tmp_path / "wf", "test-abc")
    left = layout.steps_dir / "1-pick" / "db" / "db.sqlite"
    assert FleetWorkflowRun._seed_spec(None, layout) == "-"
    assert FleetWorkflowRun._seed_spec(tmp_path / "wf" / "db" / "db.sqlite", layout) == "real"
    assert FleetWorkflowRun._seed_spec(left, layout) == "runs/test-abc/steps/1-pick/db/db.sqlite"
