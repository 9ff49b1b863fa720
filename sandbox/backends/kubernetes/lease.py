"""The fleet's workflow lock: one coordination.k8s.io Lease per workflow on the claim.

A runner on one node cannot see another node's file locks, so runners of the
scheduler placement take the workflow's Lease before their test run (each still
takes the file lock of `sandbox.prepare.lock` inside its Pod as well). The Lease
is named by a hash of the workflow's path inside the claim, so every runner of
the fleet names the same one. It is created with the holder's identity (the
runner's Pod); a Lease whose holder stopped renewing for `leaseDurationSeconds`
is taken over with the API's optimistic concurrency (an update naming the
resourceVersion read: of two runners racing for it, one wins and the other is
refused). The holder renews it every third of the duration from a thread and
deletes it when done (only if still its own: a delete preconditioned on the
Lease's uid and resourceVersion). A runner that dies leaves a Lease that expires:
its workflow is free again after the duration, never earlier.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from sandbox.contracts.errors import EngineError, RefusedError

from .podrun import api_reason

LEASE_DURATION_S = 30
LEASE_PREFIX = "sandbox-workflow-"
LABEL_LEASE = "sandbox.workflow-lease"


class LeaseHeldError(RefusedError):
    """Another runner of the fleet holds the workflow's Lease."""

    def __init__(self, workflow: str, holder: str, renewed: str) -> None:
        super().__init__(
            f"workflow {workflow} is locked by a test run of the fleet: Lease held by "
            f"{holder} (renewed {renewed})"
        )
        self.holder = holder


def lease_name(workflow: str) -> str:
    """The Lease of a workflow, by its path inside the claim (a valid object name)."""
    return LEASE_PREFIX + hashlib.sha256(workflow.encode()).hexdigest()[:40]


def _micro(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return None


class WorkflowLease:
    """Held from `acquire()` to `release()` (or a `with` block), renewed meanwhile."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        workflow: str,
        holder: str,
        duration_s: int = LEASE_DURATION_S,
    ) -> None:
        self.coordination = client.CoordinationV1Api(api)
        self.namespace, self.workflow, self.holder = namespace, workflow, holder
        self.name = lease_name(workflow)
        self.duration_s = duration_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str | None = None
        self._joined = False

    def _body(self, now: datetime, version: str | None = None) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "name": self.name,
            "labels": {LABEL_LEASE: "true"},
            "annotations": {"sandbox.workflow": self.workflow[:250]},
        }
        if version is not None:
            metadata["resourceVersion"] = version
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": self.holder,
                "leaseDurationSeconds": self.duration_s,
                "acquireTime": _micro(now),
                "renewTime": _micro(now),
            },
        }

    def acquire(self) -> None:
        """Take the Lease now or raise LeaseHeldError naming its live holder."""
        now = datetime.now(UTC)
        try:
            self.coordination.create_namespaced_lease(self.namespace, self._body(now))
        except ApiException as exc:
            if exc.status != 409:
                raise EngineError(f"taking the workflow's Lease: {api_reason(exc)}") from None
            self._take_over(now)
        self._thread = threading.Thread(target=self._renew, name="lease renew", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Share the Lease its holder (this identity) took: a chain's step runner under
        its chain's Lease. Refused unless the Lease is live and that holder's; renewed
        meanwhile (so a step outlives a controller that died only with the Lease
        held), and left, never deleted, by `release()`: the holder deletes it."""
        now = datetime.now(UTC)
        try:
            lease = self.coordination.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise RefusedError(
                    f"workflow {self.workflow}: the Lease of {self.holder} is gone "
                    "(its chain ended or its controller stopped renewing it)"
                ) from None
            raise EngineError(f"reading the workflow's Lease: {api_reason(exc)}") from None
        spec = lease.spec
        renewed = _parse(spec.renew_time) or _parse(spec.acquire_time)
        duration = spec.lease_duration_seconds or self.duration_s
        live = renewed is not None and renewed + timedelta(seconds=duration) > now
        if spec.holder_identity != self.holder or not live:
            raise LeaseHeldError(
                self.workflow,
                f"{spec.holder_identity or 'nobody'}, not {self.holder}",
                renewed.isoformat() if renewed else "never",
            )
        self._joined = True
        self._thread = threading.Thread(target=self._renew, name="lease renew", daemon=True)
        self._thread.start()

    def _take_over(self, now: datetime) -> None:
        try:
            lease = self.coordination.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            raise EngineError(f"reading the workflow's Lease: {api_reason(exc)}") from None
        spec = lease.spec
        renewed = _parse(spec.renew_time) or _parse(spec.acquire_time)
        duration = spec.lease_duration_seconds or self.duration_s
        live = renewed is not None and renewed + timedelta(seconds=duration) > now
        if spec.holder_identity and renewed is not None and live:
            raise LeaseHeldError(self.workflow, spec.holder_identity, renewed.isoformat())
        body = self._body(now, lease.metadata.resource_version)
        try:
            self.coordination.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:  # another runner took it first
                raise LeaseHeldError(self.workflow, "another runner", now.isoformat()) from None
            raise EngineError(f"taking over the workflow's Lease: {api_reason(exc)}") from None

    def _renew(self) -> None:
        while not self._stop.wait(self.duration_s / 3):
            try:
                lease = self.coordination.read_namespaced_lease(self.name, self.namespace)
                if lease.spec.holder_identity != self.holder:
                    self._lost = f"taken by {lease.spec.holder_identity}"
                    return
                lease.spec.renew_time = datetime.now(UTC)
                self.coordination.replace_namespaced_lease(self.name, self.namespace, lease)
            except ApiException as exc:
                if exc.status == 404:
                    self._lost = api_reason(exc)
                    return
                # A passing API error, or a renewal that raced another one (the holder's
                # and a joined step runner's): the next read says whose it is.

    @property
    def lost(self) -> str | None:
        """Why the Lease stopped being this holder's, if it did."""
        return self._lost

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._joined:
            return  # the holder deletes it
        with contextlib.suppress(ApiException):
            lease = self.coordination.read_namespaced_lease(self.name, self.namespace)
            if lease.spec.holder_identity != self.holder:
                return
            self.coordination.delete_namespaced_lease(
                self.name,
                self.namespace,
                body=client.V1DeleteOptions(
                    preconditions=client.V1Preconditions(
                        uid=lease.metadata.uid, resource_version=lease.metadata.resource_version
                    )
                ),
            )

    def __enter__(self) -> WorkflowLease:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
