"""Where `sandbox gc` looks for a dead fleet runner's record (pure: no cluster): a run's
folder by the id its runner announced, a chain step's folder under its chain's
`steps/` (never through a link), and nothing for a name of the wrong shape; a delete
that finds its object gone already does not stop the rest of a dead runner's
clean-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from sandbox.backends.kubernetes.fleet import (
    ANNOTATION_CHAIN,
    ANNOTATION_RUN_ID,
    ANNOTATION_WORKFLOW,
)
from sandbox.backends.kubernetes.fleetgc import _deleted, _run_root
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


def test_a_delete_that_finds_its_object_gone_is_not_an_error_and_others_are() -> None:
    """The cluster deletes a run's Secret with its Pod (its owner) while gc goes through
    the dead runner's objects: a 404 then means done, and gc goes on to the node's
    cleanup Job, the Lease and the Job (a 404 raised there left all three behind, and
    the step's mounts with them); any other refusal still reaches the report."""
    calls: list[tuple[str, str, dict[str, Any]]] = []

    def answering(status: int | None) -> Any:
        def delete(name: str, namespace: str, **options: Any) -> None:
            calls.append((name, namespace, options))
            if status is not None:
                raise ApiException(status=status, reason="refused")

        return delete

    assert _deleted(answering(None), "pod-a", "ns", grace_period_seconds=0) is True
    assert _deleted(answering(404), "secret-a", "ns") is False
    with pytest.raises(ApiException) as refused:
        _deleted(answering(403), "job-a", "ns", propagation_policy="Background")
    assert refused.value.status == 403
    assert calls == [
        ("pod-a", "ns", {"grace_period_seconds": 0}),
        ("secret-a", "ns", {}),
        ("job-a", "ns", {"propagation_policy": "Background"}),
    ]
