"""Where `sandbox gc` looks for a dead fleet runner's record (pure: no cluster): a run's
folder by the id its runner announced, a chain step's folder under its chain's
`steps/` (never through a link), and nothing for a name of the wrong shape."""

from __future__ import annotations

from pathlib import Path

from sandbox.backends.kubernetes.fleet import (
    ANNOTATION_CHAIN,
    ANNOTATION_RUN_ID,
    ANNOTATION_WORKFLOW,
)
from sandbox.backends.kubernetes.fleetgc import _run_root
from sandbox.contracts.hostconfig import BackendConfig

CHAIN = "test-20261205T120000-abc123"


def _settings(root: Path) -> BackendConfig:
    return BackendConfig(
        kind="kubernetes",
        storage="pvc",
        claim="workflows",
        claim_root=str(root),
        placement="scheduler",
        runner_image="r:1",
    )


def test_a_runs_folder_and_a_chain_steps_folder(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    runs = tmp_path / "team" / "wf" / "runs"
    (runs / CHAIN / "steps" / "1-pick").mkdir(parents=True)
    (runs / CHAIN / "steps" / "2-submit").mkdir()
    one = {ANNOTATION_WORKFLOW: "team/wf", ANNOTATION_RUN_ID: "test-x"}
    assert _run_root(settings, one) == runs / "test-x"
    step = {**one, ANNOTATION_RUN_ID: f"{CHAIN}-s2", ANNOTATION_CHAIN: CHAIN}
    assert _run_root(settings, step) == runs / CHAIN / "steps" / "2-submit"


def test_a_chain_step_of_another_chain_or_through_a_link_is_none(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    runs = tmp_path / "wf" / "runs"
    (runs / CHAIN / "steps").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (runs / CHAIN / "steps" / "1-pick").symlink_to(tmp_path / "elsewhere")
    base = {ANNOTATION_WORKFLOW: "wf", ANNOTATION_CHAIN: CHAIN}
    for run_id in (f"{CHAIN}-s1", f"{CHAIN}-s2", "test-other-s1", f"{CHAIN}-sx"):
        assert _run_root(settings, {**base, ANNOTATION_RUN_ID: run_id}) is None
    bad_chain = {**base, ANNOTATION_CHAIN: "../x", ANNOTATION_RUN_ID: "test-x-s1"}
    assert _run_root(settings, bad_chain) is None
    outside = {ANNOTATION_WORKFLOW: "../wf", ANNOTATION_RUN_ID: "test-x"}
    assert _run_root(settings, outside) is None
