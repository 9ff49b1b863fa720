"""The host config's typed builder for a cluster whose nodes hold the images already
(`BackendConfig.preloaded_cluster`): the one source of the local cluster's and the
Kubernetes bench's `[backend]`, validated as any host config is."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sandbox.contracts.hostconfig import BackendConfig


def test_a_preloaded_cluster_never_pulls_and_names_its_profile() -> None:
    settings = BackendConfig.preloaded_cluster(Path("/k/config"), "runs", "step.json")
    assert (settings.kind, settings.kubeconfig, settings.namespace) == (
        "kubernetes",
        "/k/config",
        "runs",
    )
    assert settings.image_pull_policy == "Never"
    assert settings.seccomp_profile == "step.json"
    assert (settings.storage, settings.placement) == ("hostPath", "runner")


def test_a_claim_and_a_runner_image_make_the_scheduler_placement() -> None:
    settings = BackendConfig.preloaded_cluster(
        "/k/config",
        "runs",
        "step.json",
        claim=("runs", Path("/srv/claim")),
        runner_image="sandbox-runner:t",
        image_digests={},
    )
    assert (settings.storage, settings.claim, settings.claim_root) == ("pvc", "runs", "/srv/claim")
    assert (settings.placement, settings.runner_image) == ("scheduler", "sandbox-runner:t")


def test_what_is_added_on_top_is_validated() -> None:
    with pytest.raises(ValidationError, match="placement = 'scheduler' needs"):
        BackendConfig.preloaded_cluster("/k", "runs", "step.json", placement="scheduler")
    with pytest.raises(ValidationError):
        BackendConfig.preloaded_cluster("/k", "runs", "step.json", no_such_setting=1)
