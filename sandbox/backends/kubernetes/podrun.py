"""One test run's Pod through the Kubernetes API (the official `kubernetes` client).

The runner creates the guard's Secret, then the Pod, then makes the Pod the Secret's
owner (the cluster's garbage collector deletes the Secret with the Pod, whoever
deletes the Pod). What the run learns comes from one watch of the Pod, followed by
one thread for the Pod's life (`PodWatch`), never by polling: the init container's
end, the step's start and end, the guard's end. Killing sets the Pod's deadline to now:
the kubelet stops every container and reports each one's end while the Pod stays
(deleting it is the fallback), and then the containers' logs are read.
Deleting the Pod and its Secret ends every run, and waits (on the same watch) until
the Pod is gone.

Limits: the API merges a container's stdout and stderr into one log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from sandbox.contracts.errors import EngineError
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.record import OutputTail

from . import pod as manifests

TAIL_CHARS = 8000  # as the Docker backend's tails
LOG_READ_CAP_BYTES = 64 * 1024**2  # what the runner reads of one log at most
WATCH_CHUNK_S = 10  # one watch request; a stopped watch ends within it
GONE_DEADLINE_S = 60.0
MERGE_PATCH = "application/merge-patch+json"
# The Pod's deadline, past at once: how a run stops every container of its Pod and keeps it.
STOP_NOW_PATCH = {"spec": {"activeDeadlineSeconds": 1}}
KILL_FALLBACK_S = 10.0  # then the Pod is deleted, as a Pod whose kubelet did not act
# A container the run's kill stopped, whose end the kubelet no longer reports: Docker's
# code for a killed container.
KILLED_EXIT = 137
ENGINE_ERRORS: tuple[type[Exception], ...] = (ApiException, urllib3.exceptions.HTTPError)


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


def api_reason(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"{exc.status} {exc.reason}: {str(exc.body)[:300]}"
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


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


TRANSIENT_WAITING = (None, "ContainerCreating", "PodInitializing")


@dataclass(frozen=True)
class Role:
    """One container's state as the last event showed it."""

    running: bool = False
    exit_code: int | None = None
    reason: str = ""  # the terminated reason (OOMKilled, Error, ...)
    waiting: str = ""  # why it cannot start (image missing, bad mount), if it cannot


@dataclass(frozen=True)
class PodView:
    """What one watch event says about the run's Pod."""

    phase: str = ""
    node_name: str | None = None
    firewall: Role = Role()
    guard: Role = Role()
    step: Role = Role()
    servers: tuple[tuple[str, Role], ...] = ()  # each stdio MCP server's container
    gone: bool = False

    @classmethod
    def of(cls, obj: Any) -> PodView:
        status = obj.status

        def role(statuses: list[Any] | None, name: str) -> Role:
            state = _state(statuses, name)
            if state is None:
                return Role()
            waiting = ""
            if state.waiting is not None and state.waiting.reason not in TRANSIENT_WAITING:
                waiting = f"{state.waiting.reason}: {state.waiting.message or ''}".strip()
            ended = state.terminated
            return Role(
                running=state.running is not None,
                exit_code=ended.exit_code if ended is not None else None,
                reason=(ended.reason or "") if ended is not None else "",
                waiting=waiting,
            )

        return cls(
            phase=status.phase or "",
            node_name=obj.spec.node_name,
            firewall=role(status.init_container_statuses, manifests.FIREWALL),
            guard=role(status.container_statuses, manifests.GUARD),
            step=role(status.container_statuses, manifests.STEP),
            servers=tuple(
                (s.name, role(status.container_statuses, s.name))
                for s in status.container_statuses or []
                if s.name.startswith(manifests.MCP_PREFIX)
            ),
        )

    @property
    def over(self) -> bool:
        """Nothing of the Pod runs any more, or ever will."""
        return self.gone or self.phase in ("Succeeded", "Failed")

    def role(self, name: str) -> Role:
        if name.startswith(manifests.MCP_PREFIX):
            return dict(self.servers).get(name, Role())
        return {manifests.FIREWALL: self.firewall, manifests.GUARD: self.guard}.get(name, self.step)

    def stuck(self) -> str:
        """Why a container of the Pod cannot start, if one cannot."""
        for name in (manifests.FIREWALL, manifests.GUARD, manifests.STEP, *dict(self.servers)):
            if self.role(name).waiting:
                return f"{name}: {self.role(name).waiting}"
        return ""


class PodWatch:
    """One thread following the Pod's events until it is deleted or `stop()`.

    Waiters block on a condition the thread notifies at each event; an error of the
    watch itself ends the thread and is raised to every waiter as EngineError."""

    def __init__(self, core: Any, namespace: str, name: str, resource_version: str) -> None:
        self.core, self.namespace, self.name = core, namespace, name
        self._version = resource_version
        self._cond = threading.Condition()
        self._view = PodView()
        self._error: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"watch {name}", daemon=True)
        self._thread.start()

    @property
    def view(self) -> PodView:
        with self._cond:
            return self._view

    def wait_for(self, done: Callable[[PodView], bool], timeout_s: float) -> bool:
        """True once `done(view)` holds; False when the timeout passed or the Pod went."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if done(self._view):
                    return True
                if self._error is not None:
                    raise EngineError(f"watching the run's Pod failed: {self._error}")
                if self._view.gone or not self._thread.is_alive():
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=WATCH_CHUNK_S + 5)

    def _set(self, view: PodView | None = None, *, error: str | None = None) -> None:
        with self._cond:
            if view is not None:
                self._view = view
            if error is not None:
                self._error = error
            self._cond.notify_all()

    def _follow(self) -> None:
        try:
            while not self._stopped.is_set():
                w = watch.Watch()
                try:
                    for event in w.stream(
                        self.core.list_namespaced_pod,
                        self.namespace,
                        field_selector=f"metadata.name={self.name}",
                        resource_version=self._version or None,
                        timeout_seconds=WATCH_CHUNK_S,
                    ):
                        kind, obj = event["type"], event["object"]
                        if kind == "ERROR":  # the version expired: start again from now
                            self._version = ""
                            break
                        self._version = obj.metadata.resource_version
                        if kind == "DELETED":  # its last status: the containers' ends
                            self._set(dataclasses.replace(PodView.of(obj), gone=True))
                            return
                        self._set(PodView.of(obj))
                        if self._stopped.is_set():
                            return
                except ApiException as exc:
                    if exc.status != 410:
                        raise
                    self._version = ""
                finally:
                    w.stop()
                if not self._version:
                    self._relist()
        except Exception as exc:
            self._set(error=api_reason(exc))
        finally:
            self._set()

    def _relist(self) -> None:
        """After an expired watch: the Pod as it is now, and the version to watch from."""
        try:
            obj = self.core.read_namespaced_pod(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                self._set(PodView(gone=True, node_name=self.view.node_name))
                self._stopped.set()
                return
            raise
        self._version = obj.metadata.resource_version
        self._set(PodView.of(obj))


class PodRun:
    """One run's Pod and Secret, from creation to deletion."""

    def __init__(self, core: Any, namespace: str, name: str, secret: str) -> None:
        self.core, self.namespace, self.name, self.secret = core, namespace, name, secret
        self.watch: PodWatch | None = None
        self.killed = False
        self._logs: dict[str, OutputTail] = {}

    @classmethod
    def create(cls, api: Any, pod: dict[str, Any], secret: dict[str, Any]) -> PodRun:
        """Secret, Pod, owner reference, watch. On a failure nothing of it is left."""
        core = client.CoreV1Api(api)
        namespace = pod["metadata"]["namespace"]
        run = cls(core, namespace, pod["metadata"]["name"], secret["metadata"]["name"])
        try:
            core.create_namespaced_secret(namespace, secret)
            made = core.create_namespaced_pod(namespace, pod)
            run.watch = PodWatch(core, namespace, run.name, made.metadata.resource_version)
            owner = {"apiVersion": "v1", "kind": "Pod", "name": run.name, "uid": made.metadata.uid}
            core.patch_namespaced_secret(
                run.secret,
                namespace,
                {"metadata": {"ownerReferences": [owner]}},
                _content_type=MERGE_PATCH,
            )
        except BaseException as exc:
            with contextlib.suppress(Exception):
                run.delete()
            if isinstance(exc, ApiException):
                raise EngineError(f"the cluster refused the run's Pod: {api_reason(exc)}") from None
            raise
        return run

    @property
    def view(self) -> PodView:
        return self._seen(self.watch.view if self.watch is not None else PodView())

    def wait_for(self, done: Callable[[PodView], bool], timeout_s: float) -> bool:
        assert self.watch is not None
        return self.watch.wait_for(lambda view: done(self._seen(view)), timeout_s)

    def _seen(self, view: PodView) -> PodView:
        """The Pod as the run knows it: once its own kill has failed the Pod, a container
        the last status still shows running was stopped by the kubelet (which reports no
        container's end after a Pod's phase is final): it ended, killed."""
        if not (self.killed and view.over):
            return view

        def ended(role: Role) -> Role:
            if role.exit_code is not None or not role.running:
                return role
            return Role(exit_code=KILLED_EXIT, reason="Killed")

        return dataclasses.replace(view, guard=ended(view.guard), step=ended(view.step))

    def patch(self, body: dict[str, Any]) -> None:
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod(
                self.name, self.namespace, body, _content_type=MERGE_PATCH
            )

    def kill(self) -> None:
        """Every container of the Pod stopped, its logs read first (they go with the Pod).

        The Pod's `activeDeadlineSeconds` is patched to 1: the kubelet acts on a past
        deadline at once, fails the Pod and stops its containers; once the watch sees the
        Pod over, it is deleted with its grace period, and the kubelet, with nothing
        left running, lets it go within seconds (the watch's DELETED event: `delete`
        waits for it). Deleting a Pod whose containers still ran waited 9-15 s for the
        kubelet to drop it. Should the Pod not be over within KILL_FALLBACK_S (or the
        patch be refused), it is deleted all the same: nothing outlives the run. The
        kubelet reports no container's end once the Pod has failed: those it stopped
        read as killed (`_seen`)."""
        if self.killed:
            return
        self.killed = True
        with contextlib.suppress(ApiException):
            self.core.patch_namespaced_pod(
                self.name, self.namespace, STOP_NOW_PATCH, _content_type=MERGE_PATCH
            )
            if self.watch is not None:
                self.watch.wait_for(lambda v: v.over, KILL_FALLBACK_S)
        for name in (manifests.STEP, manifests.GUARD, *dict(self.view.servers)):
            self._logs[name] = self._read_log(name)
        try:
            self.core.delete_namespaced_pod(
                self.name, self.namespace, grace_period_seconds=manifests.GRACE_S
            )
        except ApiException as exc:
            if exc.status != 404:
                raise EngineError(f"stopping the run's Pod failed: {api_reason(exc)}") from None

    def log_tail(self, container: str) -> OutputTail:
        """A container's log: as read when the Pod was stopped, else now."""
        if container in self._logs:
            return self._logs[container]
        return self._read_log(container)

    def _read_log(self, container: str) -> OutputTail:
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
        """The Pod (grace 0) and its Secret gone; waits until the Pod is. Idempotent."""
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_secret(self.secret, self.namespace)
        try:
            self.core.delete_namespaced_pod(
                self.name,
                self.namespace,
                grace_period_seconds=manifests.GRACE_S,
                propagation_policy="Background",
            )
        except ApiException as exc:
            if exc.status != 404:
                raise EngineError(f"deleting the run's Pod failed: {api_reason(exc)}") from None
        if self.watch is None:
            return
        try:
            if not self.watch.wait_for(lambda v: v.gone, GONE_DEADLINE_S):
                # The watch ended without seeing it go: ask once.
                try:
                    self.core.read_namespaced_pod(self.name, self.namespace)
                except ApiException as exc:
                    if exc.status == 404:
                        return
                raise EngineError(f"the run's Pod {self.name} was not gone in time")
        finally:
            self.watch.stop()
