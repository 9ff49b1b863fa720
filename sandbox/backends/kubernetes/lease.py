"""The fleet's workflow lock: coordination.k8s.io Leases, one per holder.

A runner on one node cannot see another node's file locks, so the fleet's lock is
kept by the API server: a test run (a runner of the scheduler placement) holds the
workflow's **exclusive Lease**, named by a hash of the workflow's path inside the
claim; a normal run (`sandbox lock --shared` with the fleet's host config) holds a
**shared Lease** of its own, labelled with that name. Each taker writes its own
Lease first and then looks for the other kind: of a shared and an exclusive taker
racing, at least one sees the other and steps back (the proof and the exact
protocol: `lease.spec.md`). A Lease whose holder stopped renewing for its
`leaseDurationSeconds` is dead: an exclusive one is taken over with the API's
optimistic concurrency, a shared one is ignored and removed. Holders renew every
third of the duration from a thread and delete their Lease when done (only their
own: a delete preconditioned on its uid and resourceVersion). A holder that dies
frees the workflow after the duration, never earlier. Apart from the lock, a Lease
marks each fleet Job started (`claim_job_start`), so a Job never runs its run twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from sandbox.contracts.errors import EngineError, RefusedError

from .podrun import api_reason

LEASE_DURATION_S = 30
# A share that meets a test run's Lease younger than this waits up to this long for it to
# go: a racing test run backs off at once when it sees the share (lease.spec.md).
RACE_SETTLE_S = 2.0
RACE_POLL_S = 0.05
LEASE_PREFIX = "sandbox-workflow-"
SHARED_PREFIX = "sandbox-shared-"
LABEL_LEASE = "sandbox.workflow-lease"
LABEL_SHARED_OF = "sandbox.shared-of"  # a shared holder's Lease: the exclusive Lease's name
ANNOTATION_WORKFLOW = "sandbox.workflow"
HOLDER_MAX = 250


STARTED_PREFIX = "sandbox-started-"


def started_name(job: str) -> str:
    """The Lease that marks a fleet Job's run as started (`claim_job_start`)."""
    return STARTED_PREFIX + job


def claim_job_start(api: Any, namespace: str, pod_name: str) -> str | None:
    """Mark this runner's Job as started; None when this Pod is the Job's first runner,
    else why this one must not run. A Job replaces a Pod that is deleted (an eviction,
    a drain) on some Kubernetes versions, whatever its `backoffLimit`: the replacement
    finds the mark and refuses, so a run is never repeated behind the controller. The
    mark is owned by the Job (the cluster deletes it with the Job); the controller and
    `sandbox gc` delete it when they delete the Job."""
    core = client.CoreV1Api(api)
    try:
        me = core.read_namespaced_pod(pod_name, namespace)
    except ApiException as exc:
        raise EngineError(f"reading the runner's own Pod: {api_reason(exc)}") from None
    jobs = [o for o in me.metadata.owner_references or [] if o.kind == "Job"]
    if not jobs:
        return f"the runner's Pod {pod_name} belongs to no Job"
    job = jobs[0]
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": started_name(job.name),
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": job.name, "uid": job.uid}
            ],
        },
        "spec": {"holderIdentity": pod_name, "acquireTime": _micro(datetime.now(UTC))},
    }
    try:
        client.CoordinationV1Api(api).create_namespaced_lease(namespace, body)
    except ApiException as exc:
        if exc.status == 409:
            return (
                f"Job {job.name} already started its run (its first runner's Pod was evicted "
                "or deleted): a run is never repeated"
            )
        raise EngineError(f"marking the Job started: {api_reason(exc)}") from None
    return None


def drop_job_start(api: Any, namespace: str, job: str) -> None:
    """The Job's started mark deleted (gone already is fine)."""
    with contextlib.suppress(ApiException):
        client.CoordinationV1Api(api).delete_namespaced_lease(started_name(job), namespace)


class LeaseHeldError(RefusedError):
    """The workflow's Leases refuse this taker: the message names the live holders."""

    def __init__(self, workflow: str, holder: str, renewed: str, *, shared: bool = False) -> None:
        if shared:
            super().__init__(
                f"workflow {workflow} is busy: cannot start a test run (exclusive); held "
                f"shared by normal runs of the fleet: {holder} (renewed {renewed})"
            )
        else:
            super().__init__(
                f"workflow {workflow} is locked by a test run of the fleet: Lease held by "
                f"{holder} (renewed {renewed})"
            )
        self.holder = holder


def lease_name(workflow: str) -> str:
    """The exclusive Lease of a workflow, by its path inside the claim (a valid name)."""
    return LEASE_PREFIX + hashlib.sha256(workflow.encode()).hexdigest()[:40]


def shared_lease_name(workflow: str) -> str:
    """A new shared holder's own Lease: unique, so two shared holders never meet."""
    digest = hashlib.sha256(workflow.encode()).hexdigest()[:40]
    return f"{SHARED_PREFIX}{digest}-{secrets.token_hex(6)}"


def default_holder(owner: str) -> str:
    """A holder identity that names the process: its owner, pid and host."""
    return f"{owner} (pid {os.getpid()} on {socket.gethostname()})"[:HOLDER_MAX]


def _micro(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return None


def _renewed(lease: Any) -> datetime | None:
    return _parse(lease.spec.renew_time) or _parse(lease.spec.acquire_time)


def _live(lease: Any, now: datetime, default_s: int) -> bool:
    """Held by a holder that renewed it within its duration (by this taker's clock)."""
    renewed = _renewed(lease)
    duration = lease.spec.lease_duration_seconds or default_s
    return (
        bool(lease.spec.holder_identity)
        and renewed is not None
        and (renewed + timedelta(seconds=duration) > now)
    )


class _HeldLease:
    """A Lease of one holder: written, renewed from a thread, deleted if still its own."""

    def __init__(
        self, api: Any, namespace: str, workflow: str, holder: str, name: str, duration_s: int
    ) -> None:
        self.coordination = client.CoordinationV1Api(api)
        self.namespace, self.workflow, self.name = namespace, workflow, name
        self.holder = holder[:HOLDER_MAX]
        self.duration_s = duration_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str | None = None
        self._joined = False

    def _labels(self) -> dict[str, str]:
        raise NotImplementedError

    def _body(self, now: datetime, version: str | None = None) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "name": self.name,
            "labels": self._labels(),
            "annotations": {ANNOTATION_WORKFLOW: self.workflow[:250]},
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

    def _start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew, name="lease renew", daemon=True)
        self._thread.start()

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
                # A passing API error, or a renewal that raced another one (a chain's
                # controller's and its joined step runner's): the next read says whose it is.

    @property
    def lost(self) -> str | None:
        """Why the Lease stopped being this holder's, if it did."""
        return self._lost

    def _delete_own(self) -> None:
        """This holder's Lease deleted, only while it is still this holder's."""
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

    def acquire(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not self._joined:  # a joined Lease is its holder's to delete
            self._delete_own()

    def __enter__(self) -> _HeldLease:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class WorkflowLease(_HeldLease):
    """The exclusive Lease of a test run, held from `acquire()` to `release()`."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        workflow: str,
        holder: str,
        duration_s: int = LEASE_DURATION_S,
    ) -> None:
        super().__init__(api, namespace, workflow, holder, lease_name(workflow), duration_s)

    def _labels(self) -> dict[str, str]:
        return {LABEL_LEASE: "true"}

    def acquire(self) -> None:
        """Take the Lease now or raise LeaseHeldError naming the live holders (the
        test run that holds it, or the normal runs that share the workflow)."""
        now = datetime.now(UTC)
        try:
            self.coordination.create_namespaced_lease(self.namespace, self._body(now))
        except ApiException as exc:
            if exc.status != 409:
                raise EngineError(f"taking the workflow's Lease: {api_reason(exc)}") from None
            self._take_over(now)
        try:
            self._no_live_shared()
        except BaseException:
            self._delete_own()
            raise
        self._start_renewing()

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
        renewed = _renewed(lease)
        if lease.spec.holder_identity != self.holder or not _live(lease, now, self.duration_s):
            raise LeaseHeldError(
                self.workflow,
                f"{lease.spec.holder_identity or 'nobody'}, not {self.holder}",
                renewed.isoformat() if renewed else "never",
            )
        self._joined = True
        self._start_renewing()

    def _take_over(self, now: datetime) -> None:
        try:
            lease = self.coordination.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            raise EngineError(f"reading the workflow's Lease: {api_reason(exc)}") from None
        if _live(lease, now, self.duration_s):
            renewed = _renewed(lease)
            when = renewed.isoformat() if renewed else "?"
            raise LeaseHeldError(self.workflow, lease.spec.holder_identity, when)
        body = self._body(now, lease.metadata.resource_version)
        try:
            self.coordination.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:  # another runner took it first
                raise LeaseHeldError(self.workflow, "another runner", now.isoformat()) from None
            raise EngineError(f"taking over the workflow's Lease: {api_reason(exc)}") from None

    def _no_live_shared(self) -> None:
        """After this Lease is written: any live shared holder refuses the test run (a
        fresh list, read after the write: see lease.spec.md); dead ones are removed."""
        try:
            found = self.coordination.list_namespaced_lease(
                self.namespace, label_selector=f"{LABEL_SHARED_OF}={self.name}"
            ).items
        except ApiException as exc:
            raise EngineError(f"listing the workflow's shared holders: {api_reason(exc)}") from None
        now = datetime.now(UTC)
        live = [x for x in found if _live(x, now, self.duration_s)]
        for dead in (x for x in found if not _live(x, now, self.duration_s)):
            with contextlib.suppress(ApiException):
                self.coordination.delete_namespaced_lease(
                    dead.metadata.name,
                    self.namespace,
                    body=client.V1DeleteOptions(
                        preconditions=client.V1Preconditions(
                            uid=dead.metadata.uid, resource_version=dead.metadata.resource_version
                        )
                    ),
                )
        if live:
            who = "; ".join(str(x.spec.holder_identity) for x in live)
            renewals = [r for r in (_renewed(x) for x in live) if r is not None]
            when = max(renewals).isoformat() if renewals else "?"
            raise LeaseHeldError(self.workflow, who, when, shared=True)


class SharedLease(_HeldLease):
    """A normal run's own Lease: shares the workflow with other normal runs, keeps
    every test run of the fleet out while held."""

    def __init__(
        self,
        api: Any,
        namespace: str,
        workflow: str,
        holder: str,
        duration_s: int = LEASE_DURATION_S,
    ) -> None:
        super().__init__(api, namespace, workflow, holder, shared_lease_name(workflow), duration_s)
        self.exclusive_name = lease_name(workflow)

    def _labels(self) -> dict[str, str]:
        return {LABEL_SHARED_OF: self.exclusive_name}

    def acquire(self) -> None:
        """Take a share now or raise LeaseHeldError naming the test run that holds
        the workflow."""
        now = datetime.now(UTC)
        try:
            self.coordination.create_namespaced_lease(self.namespace, self._body(now))
        except ApiException as exc:
            raise EngineError(f"writing the shared Lease: {api_reason(exc)}") from None
        try:
            self._no_live_test_run()
        except BaseException:
            self._delete_own()
            raise
        self._start_renewing()

    def _no_live_test_run(self) -> None:
        """After this Lease is written: a live exclusive Lease refuses the share. One
        taken less than `RACE_SETTLE_S` ago may be a racing test run that saw this share
        and is backing off: the share waits that long for it to go before refusing."""
        deadline = time.monotonic() + RACE_SETTLE_S
        while True:
            try:
                held = self.coordination.read_namespaced_lease(self.exclusive_name, self.namespace)
            except ApiException as exc:
                if exc.status == 404:
                    return
                raise EngineError(f"reading the workflow's Lease: {api_reason(exc)}") from None
            now = datetime.now(UTC)
            if not _live(held, now, self.duration_s):
                return
            taken = _parse(held.spec.acquire_time)
            settling = taken is not None and now - taken < timedelta(seconds=RACE_SETTLE_S)
            if not settling or time.monotonic() >= deadline:
                renewed = _renewed(held)
                when = renewed.isoformat() if renewed else "?"
                raise LockedByTestRunError(self.workflow, held.spec.holder_identity, when)
            time.sleep(RACE_POLL_S)


class LockedByTestRunError(LeaseHeldError):
    """A normal run's share refused: a test run of the fleet holds the workflow."""

    def __init__(self, workflow: str, holder: str, renewed: str) -> None:
        RefusedError.__init__(
            self,
            f"workflow {workflow} is busy: cannot start a run (shared); locked by a test run "
            f"of the fleet: Lease held by {holder} (renewed {renewed}). Wait for it to finish, "
            "then retry.",
        )
        self.holder = holder


# A chain on the fleet: its controller holds the workflow's Lease as `sandbox-chain-<random>`
# and leaves beside it a marker naming the chain, so `sandbox gc` finds a chain whose
# controller died (its Lease expired or deleted, and no step's runner left running).
CHAIN_PREFIX = "sandbox-chain-"
LABEL_CHAIN = "sandbox.fleet-chain"
ANNOTATION_CHAIN_RUN = "sandbox.run-id"


def chain_holder() -> str:
    """A chain's holder identity: also the name of its marker (a valid Lease name)."""
    return CHAIN_PREFIX + secrets.token_hex(6)


def mark_chain(api: Any, namespace: str, workflow: str, holder: str, chain_id: str) -> None:
    """The chain's marker: a Lease named by its holder, naming the workflow and the chain's
    run id. Never renewed: the chain's liveness is its workflow Lease's."""
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": holder,
            "labels": {LABEL_CHAIN: "true"},
            "annotations": {ANNOTATION_WORKFLOW: workflow[:250], ANNOTATION_CHAIN_RUN: chain_id},
        },
        "spec": {"holderIdentity": holder, "acquireTime": _micro(datetime.now(UTC))},
    }
    try:
        client.CoordinationV1Api(api).create_namespaced_lease(namespace, body)
    except ApiException as exc:
        raise EngineError(f"marking the chain on the cluster: {api_reason(exc)}") from None


def unmark_chain(api: Any, namespace: str, holder: str) -> None:
    """The chain's marker deleted (gone already is fine)."""
    with contextlib.suppress(ApiException):
        client.CoordinationV1Api(api).delete_namespaced_lease(holder, namespace)


def chain_markers(api: Any, namespace: str) -> list[Any]:
    """Every chain's marker in the namespace (raises ApiException)."""
    coordination = client.CoordinationV1Api(api)
    return list(
        coordination.list_namespaced_lease(namespace, label_selector=f"{LABEL_CHAIN}=true").items
    )


def chain_gone(api: Any, namespace: str, workflow: str, holder: str) -> bool:
    """Whether the chain's controller is provably gone by its Lease: the workflow's
    Lease deleted, held by another holder, or this holder's and expired (by this
    reader's clock). A dead one of this holder is deleted (preconditioned on its uid
    and resourceVersion: a renewal meanwhile keeps it). Raises ApiException on a read
    that did not answer (then nothing is known)."""
    coordination = client.CoordinationV1Api(api)
    try:
        held = coordination.read_namespaced_lease(lease_name(workflow), namespace)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    if held.spec.holder_identity != holder:
        return True
    if _live(held, datetime.now(UTC), LEASE_DURATION_S):
        return False
    with contextlib.suppress(ApiException):
        coordination.delete_namespaced_lease(
            held.metadata.name,
            namespace,
            body=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(
                    uid=held.metadata.uid, resource_version=held.metadata.resource_version
                )
            ),
        )
    return True
