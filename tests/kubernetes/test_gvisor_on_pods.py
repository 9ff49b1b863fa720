"""The gVisor wall on the Kubernetes backend: refused with its reason, never run weaker.

A RuntimeClass puts the whole Pod under gVisor, the firewall init container and the
guard with the step, where the firewall can neither be installed nor tell the guard's
traffic from the step's (docs/dev/gvisor-on-kubernetes.md). A run that asks for the
wall, by the workflow or by the run's options, is refused before any object is made
on the cluster or any folder in the workflow. (The scheduler placement refuses it
before submitting: tests/cli/test_fleet_run.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sandbox.backends import BackendFactory
from sandbox.contracts.errors import ConfigError
from sandbox.launch.runtime import POD_RUNSC_REFUSAL
from sandbox.run.testrun import RunOptions, TestRun
from tests.conftest import tree_digest, write_workflow
from tests.kubernetes.pods import no_pods_or_secrets

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    ("extra_toml", "options"),
    [
        ('[isolation]\nstep_runtime = "runsc"\n', RunOptions()),
        ("", RunOptions(step_runtime="runsc")),
    ],
    ids=["workflow", "run-option"],
)
def test_a_run_asking_for_gvisor_is_refused_with_why_and_nothing_is_made(
    kube_core: Any,
    kube_namespace: str,
    pods: BackendFactory,
    node_dir: Path,
    extra_toml: str,
    options: RunOptions,
) -> None:
    wf = write_workflow(node_dir, command="true", extra_toml=extra_toml)
    before = tree_digest(wf)
    with pytest.raises(ConfigError) as refused:
        TestRun(wf, "step1", options, backend=pods).execute()
    assert str(refused.value) == POD_RUNSC_REFUSAL
    no_pods_or_secrets(kube_core, kube_namespace)
    assert tree_digest(wf) == before
    assert not list((wf / "runs").glob("test-*")) if (wf / "runs").exists() else True
