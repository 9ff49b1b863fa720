"""Running one test run's Pod through the Kubernetes API (the official `kubernetes` client).

The only module of the run that talks to a cluster. The runner creates the guard's
Secret, then the Pod, then makes the Pod the Secret's owner (the cluster's garbage
collector deletes the Secret with the Pod, whoever deletes the Pod). Everything the
run learns comes from one watch of the Pod: the init container's end (the firewall's
read-back, checked here a second time from its log), the step's start and end, and
the guard's end. A guard that ends while the step runs gets the step killed; so does
the step's timeout. Killing sets the Pod's `activeDeadlineSeconds` to 1: the kubelet
stops every container and the Pod stays, so its logs can still be read. Deleting the
Pod (grace 0) and its Secret ends every run, and waits (a watch again) until the Pod
is gone.

Limits: the API merges a container's stdout and stderr into one log; the record's
stdout holds both (the executor's report lines are taken out, as on Docker). The
step's CPU and memory are the executor's own figures (its final rusage report); the
Pod API has no live usage without a metrics server.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from sandbox.contracts.errors import EngineError, LaunchError
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.record import OutputTail
from sandbox.launch import firewall

from . import pod as manifests

TAIL_CHARS = 8000  # as the Docker backend's tails
LOG_READ_CAP_BYTES = 64 * 1024**2  # what the runner reads of one log at most
WATCH_CHUNK_S = 30  # one watch request; the run's own deadlines come on top
START_DEADLINE_S = 180.0  # Pod created -> step running (image pulls excluded by Never)
GONE_DEADLINE_S = 60.0


def connect(settings: BackendConfig) -> Any:
    """An ApiClient from the host's kubeconfig (or in-cluster when there is none)."""
    named = settings.kubeconfig or os.environ.get("KUBECONFIG")
    if named or Path("~/.kube/config").expanduser().is_file():
        try:
            return config.new_client_from_config(config_file=named, context=settings.context)
        except (config.ConfigException, OSError) as exc:
            raise EngineError(f"kubeconfig {named or '~/.kube/config'} unusable: {exc}") from None
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException as exc:
        raise EngineError(f"no kubeconfig and not in a cluster: {exc}") from None
    return client.ApiClient(configuration)


def _tail(chunks: Iterator[bytes]) -> OutputTail:
    keep = bytearray()
    total = 0
    for chunk in chunks:
        total += len(chunk)
        keep += chunk
        if len(keep) > TAIL_CHARS * 4:
            del keep[: len(keep) - TAIL_CHARS * 4]
        if total >= LOG_READ_CAP_BYTES:
            break
    text = keep.decode("utf-8", errors="replace")
    truncated = total > len(keep) or len(text) > TAIL_CHARS
    return OutputTail(text=text[-TAIL_CHARS:], total_bytes=total, truncated=truncated)


def _state(statuses: list[Any] | None, name: str) -> Any:
    for status in statuses or []:
        if status.name == name:
            return status.state
    return None


@dataclass
class PodView:
    """What one watch event says about the run's containers."""

    phase: str = ""
    node_name: str | None = None
    init_exit: int | None = None
    step_running: bool = False
    step_exit: int | None = None
    step_reason: str = ""
    guard_running: bool = False
    guard_exit: int | None = None
    waiting: str = ""  # a container stuck before it starts (image missing, bad mount)

    @classmethod
    def of(cls, obj: Any) -> PodView:
        status = obj.status
        view = cls(phase=status.phase or "", node_name=obj.spec.node_name)
        init = _state(status.init_container_statuses, manifests.FIREWALL)
        if init is not None and init.terminated is not None:
            view.init_exit = init.terminated.exit_code
        for name in (manifests.GUARD, manifests.STEP):
            state = _state(status.container_statuses, name)
            if state is None:
                continue
            if state.waiting is not None and state.waiting.reason not in (
                None,
                "ContainerCreating",
                "PodInitializing",
            ):
                view.waiting = f"{name}: {state.waiting.reason}: {state.waiting.message or ''}"
            running = state.running is not None
            code = state.terminated.exit_code if state.terminated is not None else None
            if name == manifests.STEP:
                view.step_running, view.step_exit = running, code
                if state.terminated is not None:
                    view.step_reason = state.terminated.reason or ""
            else:
                view.guard_running, view.guard_exit = running, code
        init_waiting = init.waiting if init is not None else None
        if init_waiting is not None and init_waiting.reason not in (None, "PodInitializing"):
            view.waiting = f"firewall: {init_waiting.reason}: {init_waiting.message or ''}"
        return view

    @property
    def step_ended(self) -> bool:
        return self.step_exit is not None

    @property
    def over(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


@dataclass
class PodRun:
    """One run's Pod and Secret, from creation to deletion."""

    core: Any
    namespace: str
    name: str
    secret: str
    resource_version: str = ""
    view: PodView = field(default_factory=PodView)
    created: bool = False
    killed: bool = False

    @classmethod
    def create(cls, api: Any, pod: dict[str, Any], secret: dict[str, Any]) -> PodRun:
        core = client.CoreV1Api(api)
        namespace = pod["metadata"]["namespace"]
        run = cls(core, namespace, pod["metadata"]["name"], secret["metadata"]["name"])
        try:
            core.create_namespaced_secret(namespace, secret)
            try:
                made = core.create_namespaced_pod(namespace, pod)
            except BaseException:
                with contextlib.suppress(Exception):
                    core.delete_namespaced_secret(run.secret, namespace)
                raise
            run.created = True
            run.resource_version = made.metadata.resource_version
            owner = {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": run.name,
                "uid": made.metadata.uid,
            }
            core.patch_namespaced_secret(
                run.secret, namespace, {"metadata": {"ownerReferences": [owner]}}
            )
        except ApiException as exc:
            raise EngineError(f"the cluster refused the run's Pod: {_api_reason(exc)}") from None
        return run

    # -- watching --------------------------------------------------------------

    def follow(self, until: Callable[[PodView], bool], deadline: float) -> bool:
        """Watch the Pod until `until(view)` holds (True) or the deadline passes (False)."""
        if until(self.view):
            return True
        while time.monotonic() < deadline:
            w = watch.Watch()
            chunk = max(1, min(WATCH_CHUNK_S, int(deadline - time.monotonic()) + 1))
            try:
                for event in w.stream(
                    self.core.list_namespaced_pod,
                    self.namespace,
                    field_selector=f"metadata.name={self.name}",
                    resource_version=self.resource_version or None,
                    timeout_seconds=chunk,
                ):
                    obj = event["object"]
                    if event["type"] == "DELETED":
                        raise EngineError(f"the run's Pod {self.name} was deleted from outside")
                    if event["type"] == "ERROR":
                        self.resource_version = ""  # expired: start again from a list
                        break
                    self.resource_version = obj.metadata.resource_version
                    self.view = PodView.of(obj)
                    if until(self.view):
                        return True
                    if time.monotonic() >= deadline:
                        return False
            except ApiException as exc:
                if exc.status == 410:  # resource version too old: re-list
                    self.resource_version = ""
                    continue
                raise EngineError(f"watching the run's Pod failed: {_api_reason(exc)}") from None
            finally:
                w.stop()
        return until(self.view)

    def await_step_start(self, *, install_firewall: bool) -> None:
        """The firewall in and read back, the step running (or already ended)."""

        def started(view: PodView) -> bool:
            return view.step_running or view.step_ended or view.over or bool(view.waiting)

        if not self.follow(started, time.monotonic() + START_DEADLINE_S):
            raise LaunchError(f"the run's Pod did not start within {START_DEADLINE_S:g} s")
        if self.view.init_exit != 0:
            raise LaunchError(
                f"the run's firewall did not come up (exit {self.view.init_exit}): "
                f"{self.log_tail(manifests.FIREWALL).text[-500:]}"
            )
        readback = self.log_tail(manifests.FIREWALL).text.splitlines()
        if firewall.READY_MARK not in readback:
            raise LaunchError("the run's firewall printed no read-back")
        installed = [ln for ln in readback if ln.startswith(("-P", "-A"))]
        if install_firewall and installed != firewall.expected_readback():
            raise LaunchError(f"the run's firewall reads back wrong: {' | '.join(installed)}")
        if self.view.waiting:
            raise LaunchError(f"a container of the run's Pod cannot start: {self.view.waiting}")

    def await_step_end(self, timeout_s: float, on_guard_end: Callable[[], None]) -> int | None:
        """The step's exit code; None when its timeout passed (it is killed then).

        A guard that ends first gets the step killed at once (`on_guard_end` is told)."""
        deadline = time.monotonic() + timeout_s

        def ended_or_guard_gone(view: PodView) -> bool:
            return view.step_ended or view.over or view.guard_exit is not None

        while True:
            if not self.follow(ended_or_guard_gone, deadline):
                self.kill()
                self.follow(lambda v: v.step_ended or v.over, time.monotonic() + GONE_DEADLINE_S)
                return None
            if self.view.step_ended or self.view.over:
                return self.view.step_exit
            on_guard_end()
            self.kill()
            self.follow(lambda v: v.step_ended or v.over, time.monotonic() + GONE_DEADLINE_S)
            return self.view.step_exit

    # -- ending ----------------------------------------------------------------

    def kill(self) -> None:
        """Every container of the Pod stopped by the kubelet; the Pod and its logs stay."""
        if self.killed:
            return
        self.killed = True
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod(
                self.name, self.namespace, {"spec": {"activeDeadlineSeconds": 1}}
            )

    def log_tail(self, container: str) -> OutputTail:
        try:
            response = self.core.read_namespaced_pod_log(
                self.name, self.namespace, container=container, _preload_content=False
            )
        except ApiException:
            return OutputTail()
        try:
            return _tail(response.stream(64 * 1024))
        finally:
            response.release_conn()

    def delete(self) -> None:
        """The Pod (grace 0) and its Secret gone; waits until the Pod is."""
        if not self.created:
            return
        gone_deadline = time.monotonic() + GONE_DEADLINE_S
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_secret(self.secret, self.namespace)
        try:
            self.core.delete_namespaced_pod(
                self.name, self.namespace, grace_period_seconds=0, propagation_policy="Background"
            )
        except ApiException as exc:
            if exc.status != 404:
                raise EngineError(f"deleting the run's Pod failed: {_api_reason(exc)}") from None
        while time.monotonic() < gone_deadline:
            try:
                current = self.core.read_namespaced_pod(self.name, self.namespace)
            except ApiException as exc:
                if exc.status == 404:
                    self.created = False
                    return
                raise
            w = watch.Watch()
            try:
                for event in w.stream(
                    self.core.list_namespaced_pod,
                    self.namespace,
                    field_selector=f"metadata.name={self.name}",
                    resource_version=current.metadata.resource_version,
                    timeout_seconds=max(1, int(gone_deadline - time.monotonic())),
                ):
                    if event["type"] == "DELETED":
                        self.created = False
                        return
            finally:
                w.stop()
        raise EngineError(f"the run's Pod {self.name} was not gone within {GONE_DEADLINE_S:g} s")


def _api_reason(exc: ApiException) -> str:
    return f"{exc.status} {exc.reason}: {str(exc.body)[:300]}"
