"""The gate on a host whose runs go to a cluster: it computes the step's version with the
image references the cluster's Pods run (as the run's record names them, with no API
server asked), vouches for a verification whose images were named by digest, and says
"not verified", naming the tag, for one whose images were named by tag."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sandbox.backends.kubernetes.backend import KubernetesBackend
from sandbox.cli import main
from sandbox.contracts import names
from sandbox.contracts.config import load_workflow
from sandbox.contracts.hostconfig import PATH_ENV, BackendConfig, load_host_config
from sandbox.contracts.record import RECORD_FILE, RunStatus, TestRunRecord, Walls
from sandbox.prepare.contenthash import content_hash
from sandbox.verify import history
from sandbox.verify.gate import gate
from tests.conftest import write_workflow

DIGEST = "registry.example/sandbox-step@sha256:" + "ab" * 32
RUN_ID = "test-20250101T000000-abcdef"
PVC = 'storage = "pvc"\nclaim = "wf"\nclaim_root = "/srv"\n'
FLEET = PVC + 'placement = "scheduler"\nrunner_image = "registry.example/runner:1"\n'


def _host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> BackendConfig:
    path = tmp_path / "host.toml"
    path.write_text(f'[backend]\nkind = "kubernetes"\n{backend}')
    monkeypatch.setenv(PATH_ENV, str(path))
    return load_host_config().backend


def _verified_on_the_cluster(wf: Path, settings: BackendConfig) -> None:
    """A passing, sealed verification of step1 as a run on the cluster records it: its
    content hash over the images its backend's `require_image` gave (sandbox.record.finish)."""
    workflow = load_workflow(wf)
    step = workflow.step("step1")
    backend = KubernetesBackend(settings, api=None)
    content = content_hash(wf, workflow, step, {"step": backend.require_image(names.STEP_IMAGE)})
    now = datetime.now(UTC)
    (wf / "runs" / RUN_ID).mkdir(parents=True)
    record = TestRunRecord(
        id=RUN_ID,
        workflow_dir=str(wf),
        workflow_name="wf",
        step_id="step1",
        group="g",
        command="true",
        status=RunStatus.PASSED,
        started_at=now,
        log_synced_at=now,
        content=content,
    )
    (wf / "runs" / RUN_ID / RECORD_FILE).write_text(record.model_dump_json())
    history.append_entry(
        wf,
        history.HistoryEntry(
            run_id=RUN_ID,
            step_id="step1",
            at=now,
            passed=True,
            content=content,
            expectations_digest="",
            walls=Walls(firewall=True, seccomp=True, full=True),
        ),
    )


@pytest.mark.parametrize("placement", ["", FLEET], ids=["runner", "scheduler"])
def test_a_cluster_verification_with_images_by_digest_passes_the_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, placement: str
) -> None:
    settings = _host(
        tmp_path,
        monkeypatch,
        f'{placement}image_digests = {{ "{names.STEP_IMAGE}" = "{DIGEST}" }}\n',
    )
    wf = write_workflow(tmp_path / "w")
    _verified_on_the_cluster(wf, settings)
    result = gate(wf, "step1")
    assert result.ok, result.reason
    assert result.reason == f"step1 verified at its current version ({RUN_ID})"
    # The digest is the version: another one is another version.
    other = DIGEST.replace("ab" * 32, "cd" * 32)
    _host(tmp_path, monkeypatch, f'image_digests = {{ "{names.STEP_IMAGE}" = "{other}" }}\n')
    result = gate(wf, "step1")
    assert not result.ok and "(image step)" in result.reason, result.reason


@pytest.mark.parametrize("placement", ["", FLEET], ids=["runner", "scheduler"])
def test_a_cluster_verification_with_images_by_tag_is_not_verified_naming_the_tag(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    placement: str,
) -> None:
    settings = _host(tmp_path, monkeypatch, f'{placement}image_prefix = "registry.example/"\n')
    wf = write_workflow(tmp_path / "w")
    _verified_on_the_cluster(wf, settings)
    result = gate(wf, "step1")
    assert not result.ok
    assert result.reason == (
        "step1 not verified: the version hash could not cover image step: "
        f"registry.example/{names.STEP_IMAGE} is named by tag, not by content"
    )
    # `sandbox gate --host-config` names the same settings as the run's.
    monkeypatch.delenv(PATH_ENV)
    args = ["gate", str(wf), "step1", "--host-config", str(tmp_path / "host.toml"), "--json"]
    assert main(args) == 1
    assert json.loads(capsys.readouterr().out) == {"ok": False, "reason": result.reason}


def test_a_digest_mapping_must_name_a_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandbox.contracts.errors import ConfigError

    for bad in ("registry.example/sandbox-step:1", "sandbox-step@sha256:abc", "sha256:" + "a" * 64):
        with pytest.raises(ConfigError, match="not a reference by digest"):
            _host(tmp_path, monkeypatch, f'image_digests = {{ "{names.STEP_IMAGE}" = "{bad}" }}\n')
