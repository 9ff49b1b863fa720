"""A test run the scheduler places: the runner itself as a Job's Pod (docs/guides/fleet.md).

The controller (this module, anywhere that reaches the API server) submits one Job
per run and never touches a node. The Job's one Pod runs `fleetrunner` with the
runner image on whichever node the scheduler picks; there it does what a root
runner does on its own host (the step's disk with its kernel quota, the workflow
view, the DB copy, collect, the record) against the workflow on the shared claim,
and creates the run's Pod pinned to its own node, with `pvc` storage: the run's
Pod mounts subPaths of the same claim, and the runner's mounts reach the node
through the claim's `Bidirectional` mount propagation. The record, action log and
verification land on the claim, where the controller reads them (`record()`).

Privileges, exactly: the runner's Pod is privileged (loop devices and mounts, as
the root runner on a host is) and holds the runner service account's token (its
Role: Pods, their logs, Secrets and Leases in one namespace); the run's own Pod is
the one `pod.pod_manifest` makes, unchanged: no step or guard container gains
anything.

Cancel: deleting the Job (`cancel()`) deletes its Pod; the kubelet sends the
runner SIGTERM, which ends the run as `killed` and removes the run's Pod within
the grace period. Events: the Job's Pod's phase and node (`wait(on_event=...)`).
"""

from __future__ import annotations

import contextlib
import re
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, ConfigDict, Field

from sandbox.contracts import names
from sandbox.contracts.config import load_workflow
from sandbox.contracts.errors import ConfigError, EngineError, RefusedError
from sandbox.contracts.hostconfig import (
    DEFAULT_DURABILITY,
    BackendConfig,
    Durability,
    load_host_config,
)
from sandbox.contracts.options import RunOptions
from sandbox.contracts.record import TestRunRecord, read_record
from sandbox.contracts.recording import RecordingSettings
from sandbox.contracts.settings import runner_settings as runner_settings_of_this_host
from sandbox.launch.runtime import POD_RUNSC_REFUSAL
from sandbox.termsafe import clean

from .lease import drop_job_start
from .podrun import api_reason, connect

RUNNER_CLAIM_ROOT = "/claim"  # where the runner's Pod mounts the claim
SETTINGS_ENV = "SANDBOX_FLEET_SETTINGS"
CARRIED_ENV = "SANDBOX_FLEET_CARRIED"  # the controller's host settings the run honours
NODE_ENV = "SANDBOX_NODE_NAME"
POD_ENV = "SANDBOX_RUNNER_POD"  # the runner's Pod: the holder of the workflow's Lease
RUN_ID_MARK = "sandbox-fleet-run-id: "
REFUSED_MARK = "sandbox-fleet-refused: "
LABEL_FLEET = "sandbox.fleet-runner"
LABEL_JOB = "sandbox.fleet-job"
ANNOTATION_WORKFLOW = "sandbox.workflow"  # the workflow's path in the claim (the controller's)
ANNOTATION_RUN_ID = "sandbox.run-id"  # set by the runner at its run's first event
ANNOTATION_CHAIN = "sandbox.chain-run-id"  # a chain's step: the chain's run id
RUNNER_DEADLINE_S = 6 * 3600  # a Job whose runner hangs still ends
RUNNER_GRACE_S = 60  # the runner's clean-up after SIGTERM (the run's Pod, its mounts)
RUN_ID = re.compile(r"^test-[0-9A-Za-z_-]{1,80}$")
WATCH_CHUNK_S = 10
LAST_LINES, LAST_CHARS = 5, 800  # of a runner's log kept when it left no record


# RunOptions a runner Job does not carry (the runner runs the step with the
# workflow's own settings), by the command-line flag that sets them.
NOT_CARRIED = {
    "timeout_s": "--timeout",
    "upstream_bridge": "--upstream-bridge",
    "upstream_networks": "--upstream-network",
    "allow_hosts": "--allow-host",
    "canary": "--canary",
    "canary6": "a canary",
    "step_runtime": "--step-runtime",
    "replay": "--replay",
}


class Carried(BaseModel):
    """The controller's host settings (`host.toml`) that a one-host run honours and that
    change the record or the action log's durability, carried to the runner by its Job:
    `durability` (how the guard syncs the action log) and `[recording]` (what the guard
    keeps of each allowed read, and its caps, which the record names). The rest of
    `host.toml` is the controller's own (`[backend]`: how it reaches the cluster;
    `accept_replayed_verifications`: its gate's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    durability: Durability = DEFAULT_DURABILITY
    recording: RecordingSettings = Field(default_factory=RecordingSettings)

    @classmethod
    def of(cls, options: RunOptions) -> Carried:
        """What a run with these options honours: the options' own, else the host
        config's in effect (as `prepare.plan` resolves them on one host)."""
        host = load_host_config()
        return cls(
            durability=options.durability or host.durability,
            recording=options.recording or host.recording,
        )


def refuse_not_carried(options: RunOptions) -> None:
    """ConfigError naming every option set that a runner Job would drop; the gVisor
    wall with the reason no Pod can have it (`POD_RUNSC_REFUSAL`)."""
    if options.step_runtime == "runsc":
        raise ConfigError(POD_RUNSC_REFUSAL)
    asked = [flag for name, flag in NOT_CARRIED.items() if getattr(options, name)]
    if asked:
        raise ConfigError(
            f"{', '.join(asked)}: not carried to a run the scheduler places "
            "(placement = 'scheduler'); set it in the workflow, or run on this host"
        )


def claim_path(settings: BackendConfig, workflow_dir: Path) -> str:
    """The workflow's path inside the claim (relative), refused unless it lies under
    the controller's view of the claim's root."""
    if settings.claim_root is None:
        raise ConfigError("the scheduler placement needs the claim's root (claim_root)")
    root = Path(settings.claim_root)
    try:
        rel = Path(workflow_dir).absolute().relative_to(root)
    except ValueError:
        raise ConfigError(
            f"{workflow_dir} is not under claim_root {root}: the runner's Pod would not see it"
        ) from None
    if not rel.parts or ".." in rel.parts:
        raise ConfigError(f"{workflow_dir}: not a folder under the claim's root")
    return rel.as_posix()


def refuse_what_a_pod_cannot_hold(workflow_dir: Path, step_id: str) -> None:
    """Refused before any Job exists, from the controller's view of the workflow: a
    step it does not have; `[bridge] networks` (Docker networks: a run's Pod reaches
    its upstream through the Pod network, so the guard would run without them); and
    the gVisor wall (`POD_RUNSC_REFUSAL`), asked by the workflow or by the
    controller's `SANDBOX_STEP_RUNTIME`, which the Job does not carry (the run would
    have less than this host asked). Stdio MCP servers are not refused: they run as
    containers of the run's Pod, on the runner's node."""
    if runner_settings_of_this_host().step_runtime() == "runsc":
        raise ConfigError(POD_RUNSC_REFUSAL)
    workflow = load_workflow(workflow_dir)
    workflow.step(step_id)
    if workflow.isolation.step_runtime != "runc":
        raise ConfigError(POD_RUNSC_REFUSAL)
    if workflow.bridge.networks:
        raise ConfigError(
            f"[bridge] networks = {workflow.bridge.networks}: Docker networks, which a run "
            "the scheduler places has none of; name the upstream in [bridge] upstream by an "
            "address the cluster's Pods reach (a Service name or an IP address)"
        )


def runner_settings(settings: BackendConfig) -> BackendConfig:
    """What the runner's Pod runs with: the same cluster, in-cluster credentials, the
    claim at its own mount, placement on its own node (set there from the downward API)."""
    return settings.model_copy(
        update={
            "placement": "runner",
            "claim_root": RUNNER_CLAIM_ROOT,
            "kubeconfig": None,
            "context": None,
            "runner_host_network": False,
            "runner_api_server": None,
        }
    )


def job_manifest(
    settings: BackendConfig,
    workflow: str,
    step_id: str,
    name: str,
    *,
    env: dict[str, str] | None = None,
    host_network: bool = False,
    runner_args: Sequence[str] = (),
    carried: Carried | None = None,
    chain_id: str | None = None,
) -> dict[str, Any]:
    """The Job of one run (pure). `runner_args`: what the runner does besides running
    the step (`fleetrunner`'s options: `--verify`, a chain's step); `carried`: the
    controller's host settings the run honours; `chain_id`: the chain whose step this
    is (an annotation `sandbox gc` reads). `env` and
    `host_network` (added to the settings' `runner_api_server` and
    `runner_host_network`) are for clusters whose Pods reach the API server only
    through the node (the local test cluster)."""
    if settings.placement != "scheduler" or settings.runner_image is None:
        raise ConfigError("a Job of the fleet needs placement = 'scheduler' and runner_image")
    labels = {LABEL_FLEET: "true", LABEL_JOB: name}
    env = dict(env or {})
    if settings.runner_api_server is not None:
        host, port = settings.runner_api_server.rsplit(":", 1)
        env.setdefault("KUBERNETES_SERVICE_HOST", host)
        env.setdefault("KUBERNETES_SERVICE_PORT", port)
    host_network = host_network or settings.runner_host_network
    container_env: list[dict[str, Any]] = [
        {"name": NODE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": POD_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": SETTINGS_ENV, "value": runner_settings(settings).model_dump_json()},
        {"name": CARRIED_ENV, "value": (carried or Carried()).model_dump_json()},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        # The run's Pod runs the images this controller names.
        {"name": "SANDBOX_IMAGE_TAG", "value": names.IMAGE_TAG},
        *({"name": k, "value": v} for k, v in sorted(env.items())),
    ]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": settings.runner_service_account,
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": RUNNER_GRACE_S,
        "containers": [
            {
                "name": "runner",
                "image": settings.runner_image,
                "imagePullPolicy": settings.image_pull_policy,
                "command": [
                    "python3",
                    "-m",
                    "sandbox.backends.kubernetes.fleetrunner",
                    workflow,
                    step_id,
                    *runner_args,
                ],
                "env": container_env,
                # Loop devices and mounts, as the root runner on a host; the run's own
                # Pod (made by this runner) is the unprivileged one of pod.pod_manifest.
                "securityContext": {"privileged": True, "runAsUser": 0},
                "volumeMounts": [
                    {
                        "name": "claim",
                        "mountPath": RUNNER_CLAIM_ROOT,
                        # The disk and view the runner mounts reach the node, so the
                        # run's Pod (pinned here) mounts them through the claim.
                        "mountPropagation": "Bidirectional",
                    }
                ],
            }
        ],
        "volumes": [{"name": "claim", "persistentVolumeClaim": {"claimName": settings.claim}}],
    }
    if host_network:
        pod_spec["hostNetwork"] = True
    if settings.node_selector:
        pod_spec["nodeSelector"] = dict(settings.node_selector)
    annotations = {ANNOTATION_WORKFLOW: workflow}
    if chain_id is not None:
        if not RUN_ID.match(chain_id):
            raise ConfigError(f"{chain_id!r} is not a chain's run id")
        annotations[ANNOTATION_CHAIN] = chain_id
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,  # a run is never repeated behind the controller's back
            "activeDeadlineSeconds": RUNNER_DEADLINE_S,
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


class FleetRun:
    """One submitted run: its Job, its runner's Pod, then its record on the claim."""

    def __init__(self, api: Any, settings: BackendConfig, workflow_dir: Path, name: str) -> None:
        self.api, self.settings, self.workflow_dir, self.name = api, settings, workflow_dir, name
        self.batch = client.BatchV1Api(api)
        self.core = client.CoreV1Api(api)
        self.node: str | None = None
        self.runner_pod: str | None = None  # the Job's first Pod: the run's runner
        self.run_id: str | None = None
        self.refused: str | None = None  # why the runner refused to start the run
        self.ended: Any = None  # the runner's Pod as its end was seen (None: unseen)
        self.ended_deleted = False  # its end was its Pod's deletion
        self.last_lines = ""  # the runner's log, its last lines (escaped), once it ended

    @classmethod
    def submit(
        cls,
        settings: BackendConfig,
        workflow_dir: Path,
        step_id: str,
        *,
        api: Any = None,
        env: dict[str, str] | None = None,
        host_network: bool = False,
        runner_args: Sequence[str] = (),
        carried: Carried | None = None,
        chain_id: str | None = None,
    ) -> FleetRun:
        """The run's Job created. `carried`: the host settings the run honours (None:
        the host config in effect here, `Carried.of`)."""
        workflow = claim_path(settings, workflow_dir)
        refuse_what_a_pod_cannot_hold(Path(workflow_dir), step_id)
        name = f"sandbox-run-{secrets.token_hex(5)}"
        manifest = job_manifest(
            settings,
            workflow,
            step_id,
            name,
            env=env,
            host_network=host_network,
            runner_args=runner_args,
            carried=carried if carried is not None else Carried.of(RunOptions()),
            chain_id=chain_id,
        )
        api = api if api is not None else connect(settings)
        run = cls(api, settings, Path(workflow_dir).absolute(), name)
        try:
            run.batch.create_namespaced_job(settings.namespace, manifest)
        except ApiException as exc:
            raise EngineError(f"the cluster refused the run's Job: {api_reason(exc)}") from None
        return run

    def _pod(self) -> Any:
        pods = self.core.list_namespaced_pod(
            self.settings.namespace, label_selector=f"{LABEL_JOB}={self.name}"
        ).items
        first = [p for p in pods if p.metadata.name == self.runner_pod]
        pod = (first or sorted(pods, key=lambda p: p.metadata.creation_timestamp) or [None])[0]
        if pod is not None and self.runner_pod is None:
            self.runner_pod = pod.metadata.name  # the runner this controller saw first
        if pod is not None:
            self._note_run_id(pod)
        return pod

    def wait(
        self, timeout_s: float, on_event: Callable[[str, dict[str, Any]], None] | None = None
    ) -> bool:
        """Until the runner's Pod ended (True) or the timeout passed (False); reports
        the Pod's node once scheduled and each phase it reaches."""
        deadline = time.monotonic() + timeout_s
        seen_phase = ""
        while time.monotonic() < deadline:
            if self.runner_pod is not None and not self._exists(self.runner_pod):
                self.ended_deleted = True
                return True  # ended and deleted (an eviction) between two watches
            w = watch.Watch()
            try:
                for event in w.stream(
                    self.core.list_namespaced_pod,
                    self.settings.namespace,
                    label_selector=f"{LABEL_JOB}={self.name}",
                    timeout_seconds=int(min(WATCH_CHUNK_S, max(1, deadline - time.monotonic()))),
                ):
                    pod = event["object"]
                    if self.runner_pod is None:
                        self.runner_pod = pod.metadata.name
                    if pod.metadata.name != self.runner_pod:
                        continue  # a Pod the Job made again after an eviction: it refuses
                    self._note_run_id(pod)
                    if pod.spec.node_name and self.node is None:
                        self.node = pod.spec.node_name
                        if on_event is not None:
                            on_event("placed", {"node": self.node, "pod": pod.metadata.name})
                    phase = pod.status.phase or ""
                    if phase != seen_phase:
                        seen_phase = phase
                        if on_event is not None:
                            on_event("runner", {"phase": phase, "node": self.node})
                    if phase in ("Succeeded", "Failed") or event["type"] == "DELETED":
                        w.stop()
                        self.ended, self.ended_deleted = pod, event["type"] == "DELETED"
                        self._learn_run_id(pod.metadata.name)
                        return True
            except ApiException as exc:
                raise EngineError(f"watching the run's Job failed: {api_reason(exc)}") from None
            finally:
                w.stop()
        return False

    def _exists(self, pod_name: str) -> bool:
        try:
            self.core.read_namespaced_pod(pod_name, self.settings.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise EngineError(f"reading the runner's Pod: {api_reason(exc)}") from None
        return True

    def _note_run_id(self, pod: Any) -> None:
        """The run's id as the runner announced it on its Pod at the run's first event
        (known before the run ends: a cancelled run's record is found by it)."""
        candidate = (pod.metadata.annotations or {}).get(ANNOTATION_RUN_ID)
        if self.run_id is None and isinstance(candidate, str) and RUN_ID.match(candidate):
            self.run_id = candidate

    def _learn_run_id(self, pod_name: str) -> None:
        """The run's id, from the runner's last line (a trusted component: the runner,
        not the step), checked against the id's shape before it names a folder."""
        with contextlib.suppress(ApiException):
            log = self.core.read_namespaced_pod_log(
                pod_name, self.settings.namespace, container="runner", tail_lines=50
            )
            tail = str(log).splitlines()[-LAST_LINES:]
            self.last_lines = clean(" | ".join(tail), keep_newlines=False)[-LAST_CHARS:]
            for line in reversed(str(log).splitlines()):
                if line.startswith(REFUSED_MARK):
                    self.refused = line[len(REFUSED_MARK) :].strip()[:500]
                    return
                if line.startswith(RUN_ID_MARK):
                    candidate = line[len(RUN_ID_MARK) :].strip()
                    if RUN_ID.match(candidate):
                        self.run_id = candidate
                    return

    def record(self) -> TestRunRecord:
        """The record the runner sealed on the claim, read from the controller's view."""
        if self.refused is not None:
            raise RefusedError(self.refused)
        if self.run_id is None:
            raise EngineError(f"the runner of Job {self.name} named no run (see its Pod's log)")
        return read_record(self.workflow_dir / "runs" / self.run_id)

    def how_it_ended(self) -> tuple[bool, str]:
        """How the runner ended, once `wait` saw it end: (killed, what happened).
        Killed: its container ended by a signal (SIGKILL, OOM) or its Pod was deleted
        (evicted, drained, its node lost) before its container ended; else it exited
        by itself, with its code."""
        pod = self.ended
        statuses = (pod.status.container_statuses or []) if pod is not None else []
        for status in statuses:
            ended = status.state.terminated if status.state is not None else None
            if status.name != "runner" or ended is None:
                continue
            code, why = ended.exit_code, ended.reason or "no reason given"
            if why == "OOMKilled" or code > 128 or code < 0:
                return True, f"was killed ({why}, exit code {code})"
            return False, f"exited with code {code} ({why})"
        if pod is None or self.ended_deleted:
            return True, "lost its Pod (deleted or evicted) before it ended"
        return True, f"ended {pod.status.phase} ({pod.status.reason or 'no container state'})"

    def cancel(self) -> None:
        """The Job and its Pod deleted: the runner gets SIGTERM and records `killed`."""
        with contextlib.suppress(ApiException):
            self.batch.delete_namespaced_job(
                self.name, self.settings.namespace, propagation_policy="Foreground"
            )
        drop_job_start(self.api, self.settings.namespace, self.name)

    def delete(self) -> None:
        """The finished Job removed (its Pod with it)."""
        with contextlib.suppress(ApiException):
            self.batch.delete_namespaced_job(
                self.name, self.settings.namespace, propagation_policy="Background"
            )
        drop_job_start(self.api, self.settings.namespace, self.name)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.api.close()


def runner_role(namespace: str, service_account: str = "sandbox-runner") -> list[dict[str, Any]]:
    """What an operator applies once per namespace: the runner's service account, its
    Role (only what the runner calls) and the binding (docs/guides/fleet.md)."""
    rules = [
        {
            "apiGroups": [""],
            "resources": ["pods"],
            "verbs": ["create", "get", "list", "watch", "patch", "delete"],
        },
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "patch", "delete"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            # list: the normal runs' shared Leases a test run must not start beside
            "verbs": ["create", "get", "list", "update", "delete"],
        },
    ]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": service_account, "namespace": namespace},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": service_account, "namespace": namespace},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": service_account, "namespace": namespace},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": service_account,
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
            ],
        },
    ]


def run_pod_budget(namespace: str, api_version: str = "policy/v1") -> dict[str, Any]:
    """The PodDisruptionBudget an operator applies once per namespace: no run's Pod is
    evicted on its own (`kubectl drain` waits); a drain evicts the runner's Pod, whose
    runner ends the run `killed` and deletes the run's Pod itself within its grace
    period (docs/guides/fleet.md). The runner's Pod has no budget: a drain never waits
    on a run longer than that grace period. `api_version`: `policy/v1beta1` for a
    cluster older than Kubernetes 1.21."""
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "sandbox-run-pods", "namespace": namespace},
        "spec": {
            "maxUnavailable": 0,
            "selector": {"matchLabels": {names.LABEL_MANAGED: "true"}},
        },
    }
