"""`placement = "scheduler"` from the command line, where no cluster is needed: what the
fleet cannot carry is refused before anything is submitted, and nothing runs on this
host in its place. (Runs through the fleet: tests/kubernetes/test_fleet.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.contracts.exitcodes import ExitCode
from sandbox.contracts.settings import STEP_RUNTIME_ENV
from sandbox.launch.runtime import POD_RUNSC_REFUSAL
from tests.conftest import tree_digest, write_workflow


def _scheduler_host(tmp_path: Path) -> Path:
    toml = tmp_path / "host.toml"
    toml.write_text(
        "[backend]\n"
        'kind = "kubernetes"\n'
        f'kubeconfig = "{tmp_path / "no-such.kubeconfig"}"\n'
        'placement = "scheduler"\n'
        'storage = "pvc"\n'
        'claim = "workflows"\n'
        f'claim_root = "{tmp_path}"\n'
        'runner_image = "sandbox-runner:none"\n'
    )
    return toml


def _sandbox(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("command", [["run"], ["verify"], ["run-workflow"]])
@pytest.mark.parametrize(
    ("option", "flag"),
    [
        (["--timeout", "5"], "--timeout"),
        (["--allow-host", "example.org"], "--allow-host"),
    ],
)
def test_run_options_the_fleet_does_not_carry_are_refused_before_submitting(
    tmp_path: Path, command: list[str], option: list[str], flag: str
) -> None:
    wf = write_workflow(tmp_path)
    before = tree_digest(wf)
    host = _scheduler_host(tmp_path)
    step = [] if command == ["run-workflow"] else ["step1"]
    done = _sandbox(*command, str(wf), *step, "--host-config", str(host), "--json", *option)
    assert done.returncode == ExitCode.CONFIG, done.stderr
    message = json.loads(done.stderr)["error"]["message"]
    assert flag in message and "scheduler" in message
    assert tree_digest(wf) == before
    assert not (wf / "runs").exists() or not list((wf / "runs").glob("test-*"))


@pytest.mark.parametrize(
    ("option", "extra_toml", "env"),
    [
        (["--step-runtime", "runsc"], "", {}),
        ([], '[isolation]\nstep_runtime = "runsc"\n', {}),
        ([], "", {STEP_RUNTIME_ENV: "runsc"}),
    ],
    ids=["run-option", "workflow", "environment"],
)
def test_the_gvisor_wall_is_refused_on_the_fleet_with_why_before_submitting(
    tmp_path: Path, option: list[str], extra_toml: str, env: dict[str, str]
) -> None:
    """Asked by the run, the workflow or the controller's environment: refused with the
    reason, never submitted (the kubeconfig does not exist: a submission would fail on
    connecting instead)."""
    wf = write_workflow(tmp_path, extra_toml=extra_toml)
    before = tree_digest(wf)
    host = _scheduler_host(tmp_path)
    args = ("run", str(wf), "step1", "--host-config", str(host), "--json", *option)
    done = _sandbox(*args, env=env)
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert json.loads(done.stderr)["error"]["message"] == POD_RUNSC_REFUSAL
    assert tree_digest(wf) == before


def test_a_replay_is_refused_on_the_fleet_not_dropped(tmp_path: Path) -> None:
    wf = write_workflow(tmp_path)
    host = _scheduler_host(tmp_path)
    for command in ("run", "verify"):
        argv = [command, str(wf), "step1", "--host-config", str(host), "--json"]
        done = _sandbox(*argv, "--replay", "test-x")
        assert done.returncode == ExitCode.CONFIG, done.stderr
        assert "--replay" in json.loads(done.stderr)["error"]["message"]


def test_a_chain_verification_with_the_scheduler_placement_is_refused_not_run_on_this_host(
    tmp_path: Path,
) -> None:
    wf = write_workflow(tmp_path)
    expectations = tmp_path / "expect.toml"
    expectations.write_text("")
    host = _scheduler_host(tmp_path)
    done = _sandbox("verify-workflow", str(wf), str(expectations), "--host-config", str(host))
    assert done.returncode == ExitCode.CONFIG, (done.stdout, done.stderr)
    assert "placement = 'scheduler'" in done.stderr and "verify-workflow" in done.stderr


def test_verify_on_the_fleet_parses_the_expectations_before_submitting(tmp_path: Path) -> None:
    """As on one host: a step without expectations is a config error, and no Job is
    submitted (the host config's kubeconfig does not even exist)."""
    wf = write_workflow(tmp_path)
    host = _scheduler_host(tmp_path)
    done = _sandbox("verify", str(wf), "step1", "--host-config", str(host), "--json")
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert "no expectations" in json.loads(done.stderr)["error"]["message"]
