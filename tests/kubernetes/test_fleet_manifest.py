"""The fleet's Job and settings as plain data (no cluster): what the runner's Pod may
hold, and what the controller refuses before it submits anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sandbox.backends.kubernetes import fleet, fleetclean
from sandbox.contracts import names
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.hostconfig import BackendConfig
from tests.conftest import write_workflow

pytestmark = pytest.mark.kubernetes


def _settings(**changes: object) -> BackendConfig:
    base: dict[str, object] = {
        "kind": "kubernetes",
        "namespace": "runs",
        "storage": "pvc",
        "claim": "workflows",
        "claim_root": "/srv/workflows",
        "placement": "scheduler",
        "runner_image": "registry.example.org/sandbox-runner:1",
        "kubeconfig": "/etc/sandbox/kubeconfig",
    }
    return BackendConfig.model_validate({**base, **changes})


def test_the_scheduler_placement_needs_a_claim_and_a_runner_image() -> None:
    with pytest.raises(ValidationError, match="placement = 'scheduler'"):
        BackendConfig(kind="kubernetes", placement="scheduler", runner_image="r:1")
    with pytest.raises(ValidationError, match="placement = 'scheduler'"):
        _settings(runner_image=None)


def test_a_workflow_outside_the_claim_is_refused_before_any_job() -> None:
    settings = _settings()
    assert fleet.claim_path(settings, Path("/srv/workflows/team/wf")) == "team/wf"
    for outside in ("/srv/other/wf", "/srv/workflows", "/srv/workflows/../etc"):
        with pytest.raises(ConfigError):
            fleet.claim_path(settings, Path(outside))


def test_only_the_runner_is_privileged_and_it_holds_only_its_namespaced_role() -> None:
    job = fleet.job_manifest(_settings(), "team/wf", "step1", "sandbox-run-x")
    assert job["spec"]["backoffLimit"] == 0
    template = job["spec"]["template"]
    assert template["metadata"]["annotations"] == {fleet.ANNOTATION_WORKFLOW: "team/wf"}
    pod = template["spec"]
    assert pod["serviceAccountName"] == "sandbox-runner"
    assert "hostNetwork" not in pod and "hostPID" not in pod
    (runner,) = pod["containers"]
    assert runner["securityContext"] == {"privileged": True, "runAsUser": 0}
    assert runner["volumeMounts"] == [
        {"name": "claim", "mountPath": "/claim", "mountPropagation": "Bidirectional"}
    ]
    assert pod["volumes"] == [
        {"name": "claim", "persistentVolumeClaim": {"claimName": "workflows"}}
    ]
    env = {e["name"]: e for e in runner["env"]}
    assert env["SANDBOX_IMAGE_TAG"]["value"] == names.IMAGE_TAG
    inner = BackendConfig.model_validate_json(env[fleet.SETTINGS_ENV]["value"])
    # In the Pod: its own credentials, the claim at its mount, the run's Pod on its node.
    assert inner.kubeconfig is None and inner.claim_root == "/claim"
    assert inner.placement == "runner"
    assert env[fleet.NODE_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"

    account, role, binding = fleet.runner_role("runs")
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == "runs"
    granted = {(r["apiGroups"][0], res) for r in role["rules"] for res in r["resources"]}
    assert granted == {
        ("", "pods"),
        ("", "pods/log"),
        ("", "secrets"),
        ("coordination.k8s.io", "leases"),
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "runs"}
    ]


def test_the_runner_runs_the_images_by_the_digests_the_controller_names() -> None:
    digests = {names.STEP_IMAGE: "registry.example.org/sandbox-step@sha256:" + "c" * 64}
    job = fleet.job_manifest(_settings(image_digests=digests), "team/wf", "step1", "run-x")
    (runner,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in runner["env"]}
    inner = BackendConfig.model_validate_json(env[fleet.SETTINGS_ENV])
    assert inner.image_digests == digests
    assert inner.image_ref(names.STEP_IMAGE) == digests[names.STEP_IMAGE]


def test_the_runner_api_settings_shape_the_job_and_stay_with_the_controller() -> None:
    """`runner_host_network` and `runner_api_server` (a cluster whose Pods reach the API
    server only through their node) go into the Job, not into the runner's settings."""
    settings = _settings(runner_host_network=True, runner_api_server="127.0.0.1:6443")
    pod = fleet.job_manifest(settings, "team/wf", "step1", "sandbox-run-x")["spec"]["template"]
    assert pod["spec"]["hostNetwork"] is True
    (runner,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in runner["env"]}
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == "6443"
    inner = BackendConfig.model_validate_json(env[fleet.SETTINGS_ENV])
    assert inner.runner_api_server is None and inner.runner_host_network is False
    for bad in ("127.0.0.1", "a b:1", "host:port"):
        with pytest.raises(ValidationError):
            _settings(runner_api_server=bad)


def test_the_cleanup_job_is_pinned_to_the_dead_runners_node_and_holds_no_token() -> None:
    """What `sandbox gc` submits for a dead runner: privileged on that node only (by
    `nodeName`, so a cordoned node runs it), the claim as the runner mounts it (its
    unmounts reach the node), no service-account token, a deadline."""
    job = fleetclean.cleanup_job_manifest(
        _settings(), "team/wf", "test-20260101-abc", "node-7", "sandbox-clean-x"
    )
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["activeDeadlineSeconds"] == fleetclean.CLEANUP_DEADLINE_S
    assert job["metadata"]["labels"] == {fleetclean.LABEL_CLEANUP: "test-20260101-abc"}
    assert fleet.LABEL_FLEET not in job["spec"]["template"]["metadata"]["labels"]
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeName"] == "node-7"
    assert pod["automountServiceAccountToken"] is False
    assert "hostNetwork" not in pod and "hostPID" not in pod
    (cleanup,) = pod["containers"]
    assert cleanup["command"][-2:] == ["team/wf", "test-20260101-abc"]
    assert cleanup["volumeMounts"] == [
        {"name": "claim", "mountPath": "/claim", "mountPropagation": "Bidirectional"}
    ]
    assert "env" not in cleanup or all(e["name"] != fleet.SETTINGS_ENV for e in cleanup["env"])


def test_the_run_pods_budget_refuses_every_eviction_of_a_runs_pod_only() -> None:
    budget = fleet.run_pod_budget("runs")
    assert budget["apiVersion"] == "policy/v1" and budget["kind"] == "PodDisruptionBudget"
    assert budget["spec"]["maxUnavailable"] == 0
    assert budget["spec"]["selector"] == {"matchLabels": {names.LABEL_MANAGED: "true"}}
    job = fleet.job_manifest(_settings(), "team/wf", "step1", "sandbox-run-x")
    runner_labels = job["spec"]["template"]["metadata"]["labels"]
    assert names.LABEL_MANAGED not in runner_labels  # the runner's Pod: evicted by a drain


def test_what_a_run_s_pod_cannot_hold_is_refused_from_the_controller_s_view(
    tmp_path: Path,
) -> None:
    """Docker networks and a step the workflow lacks: refused before any Job; stdio
    MCP servers pass (they run in the run's Pod)."""
    servers = '[[mcp_servers]]\nname = "tools"\ncommand = ["python3", "/workflow/code/s.py"]\n'
    wf = write_workflow(tmp_path, "served", extra_toml=servers)
    fleet.refuse_what_a_pod_cannot_hold(wf, "step1")
    with pytest.raises(ConfigError, match="unknown step"):
        fleet.refuse_what_a_pod_cannot_hold(wf, "nope")
    networks = '[bridge]\nupstream = "http://up:8080"\nnetworks = ["upstreams"]\n'
    wf = write_workflow(tmp_path, "networked", extra_toml=networks)
    with pytest.raises(ConfigError, match=r"\[bridge\] networks = \['upstreams'\]"):
        fleet.refuse_what_a_pod_cannot_hold(wf, "step1")


def test_the_job_carries_the_controllers_durability_and_recording_and_a_chains_id() -> None:
    """`fleet.Carried` (the controller's `durability` and `[recording]`) in the runner's
    environment, and a chain's step annotated with its chain's run id."""
    from sandbox.contracts.recording import RecordingSettings

    carried = fleet.Carried(
        durability="per-call", recording=RecordingSettings(cap_bytes=5, body_cap_bytes=3)
    )
    job = fleet.job_manifest(
        _settings(), "team/wf", "step1", "sandbox-run-x", carried=carried, chain_id="test-c1"
    )
    template = job["spec"]["template"]
    assert template["metadata"]["annotations"] == {
        fleet.ANNOTATION_WORKFLOW: "team/wf",
        fleet.ANNOTATION_CHAIN: "test-c1",
    }
    (runner,) = template["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in runner["env"]}
    assert fleet.Carried.model_validate_json(env[fleet.CARRIED_ENV]) == carried
    plain = fleet.job_manifest(_settings(), "team/wf", "step1", "sandbox-run-y")
    (runner,) = plain["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in runner["env"]}
    assert fleet.Carried.model_validate_json(env[fleet.CARRIED_ENV]) == fleet.Carried()
    with pytest.raises(ConfigError):
        fleet.job_manifest(_settings(), "team/wf", "s", "sandbox-run-z", chain_id="../x")
