"""Start-up on a cluster: a no-op test run as a Pod, and one the scheduler places (a
fleet's run, `bench/kubefleet.py`), each vs a bare one-container Pod on the same cluster
(`sandbox bench --only kubernetes`, `make bench-kubernetes`).

Not part of a plain `make bench`: it needs a cluster. The cluster is the host config's
(`[backend] kind = "kubernetes"`: its kubeconfig, namespace, images and seccomp
profile, with the runner on a node that its hostPath or claim storage reaches), or,
when the host config names none, the local test cluster of `testbed/kubernetes/`,
started for the duration of the benchmark and stopped after it (the same cluster
`make test-kubernetes` uses, nothing of it outliving the bench).

Both sides go through the same API client and end the same way, watched, never polled:
- the test run: `TestRun(...).execute()` of a `true` step through the Kubernetes
  backend, from the call to its record (Secret and Pod made, the firewall's init
  container, the guard, the step, the Pod deleted and gone, the record written);
- the bare Pod: one container of the step image running `true`, no hardening, created,
  its container's end seen (the fleet's baseline), deleted and gone (the Pod run's);
- the fleet's run (`placement = "scheduler"`): submitted to its record read from the
  claim, on the local cluster's two nodes (or the host config's fleet).

Interleaved, one warm-up of each not counted; each figure is the ratio of the medians.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import BENCH_LABEL, Bench, BenchError, write_workflow
from bench.kubefleet import Fleet, fleet_run_s, local_fleet, noop_workflow
from bench.results import Goal, PhaseBreakdown, Row, make_row, status_row
from sandbox.contracts import names
from sandbox.contracts.hostconfig import BackendConfig, load_host_config
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.run.testrun import TestRun

WATCH_DEADLINE_S = 120
FLEET_ROW = "kubernetes_fleet_startup"


@dataclass
class Target:
    """Where the benchmark runs: the cluster's settings, and a folder its node sees."""

    settings: BackendConfig
    work: Path
    label: str
    fleet: Fleet | None = None  # where runs the scheduler places go, when there is one


@contextlib.contextmanager
def _local_cluster(b: Bench) -> Iterator[Target]:
    """The local test cluster, a namespace of the bench's own and a folder on its node."""
    from kubernetes import client

    from testbed.kubernetes.cluster import SECCOMP_DIR, Cluster
    from testbed.kubernetes.namespace import namespace_of_its_own

    b.say("kubernetes: starting the local test cluster (testbed/kubernetes), loading the images")
    cluster = Cluster.start(
        images=(names.STEP_IMAGE, names.GUARD_IMAGE),
        nodes=2,
        log=lambda m: b.say(f"kubernetes: {m}"),
    )
    try:
        profile = cluster.install_seccomp_profile(SECCOMP_DIR / "step.oci.json", "step.json")
        api = cluster.api_client()
        try:
            with namespace_of_its_own(client.CoreV1Api(api)) as namespace:
                work = cluster.node_storage / f"bench-{secrets.token_hex(4)}"
                work.mkdir()
                work.chmod(0o755)
                b.say("kubernetes: the runner image, its RBAC and a claim for the fleet")
                try:
                    with local_fleet(cluster, api, namespace, profile) as fleet:
                        yield Target(
                            BackendConfig.preloaded_cluster(cluster.kubeconfig, namespace, profile),
                            work,
                            "the local test cluster (two nodes)",
                            fleet,
                        )
                finally:
                    shutil.rmtree(work, ignore_errors=True)
        finally:
            api.close()
    finally:
        cluster.stop()


@contextlib.contextmanager
def cluster_target(b: Bench) -> Iterator[Target]:
    """The host config's cluster when it names one, else the local test cluster."""
    settings = load_host_config().backend
    if settings.kind == "kubernetes":
        b.say(f"kubernetes: the host config's cluster, namespace {settings.namespace}")
        on_claim = settings.storage == "pvc" and settings.claim_root
        work = Path(settings.claim_root) if on_claim and settings.claim_root else b.work
        folder = work / f"bench-{secrets.token_hex(4)}"
        folder.mkdir()
        folder.chmod(0o755)
        fleet = Fleet(settings) if settings.placement == "scheduler" else None
        try:
            yield Target(settings, folder, "the host config's cluster", fleet)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    with _local_cluster(b) as target:
        yield target


def _watch_until(core: Any, namespace: str, name: str, version: str, done: Any) -> None:
    """Until `done(event type, pod)` holds for an event of the Pod (one watch)."""
    from kubernetes import watch

    w = watch.Watch()
    deadline = time.monotonic() + WATCH_DEADLINE_S
    try:
        while time.monotonic() < deadline:
            for event in w.stream(
                core.list_namespaced_pod,
                namespace,
                field_selector=f"metadata.name={name}",
                resource_version=version,
                timeout_seconds=max(1, int(deadline - time.monotonic())),
            ):
                version = event["object"].metadata.resource_version
                if done(event["type"], event["object"]):
                    return
    finally:
        w.stop()
    raise BenchError(f"the bare Pod {name} did not get there within {WATCH_DEADLINE_S} s")


def _ended(pod: Any) -> bool:
    for status in pod.status.container_statuses or []:
        if status.state.terminated is not None:
            return True
    return False


def bare_pod_s(
    core: Any, settings: BackendConfig, bench_id: str, index: int
) -> tuple[float, float]:
    """Seconds from its creation to its one `true` container's end, and to the Pod
    deleted and gone."""
    name = f"sandbox-bench-bare-{bench_id[-8:].lower()}-{index}"
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {BENCH_LABEL: "true"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 1,
            **({"nodeSelector": dict(settings.node_selector)} if settings.node_selector else {}),
            **({"nodeName": settings.node_name} if settings.node_name else {}),
            "containers": [
                {
                    "name": "c",
                    "image": settings.image_ref(names.STEP_IMAGE),
                    "imagePullPolicy": settings.image_pull_policy,
                    "command": ["true"],
                }
            ],
        },
    }
    namespace = settings.namespace
    started = time.perf_counter()
    created = core.create_namespaced_pod(namespace, manifest)
    ended = 0.0
    try:
        version = created.metadata.resource_version
        _watch_until(core, namespace, name, version, lambda kind, pod: _ended(pod))
        ended = time.perf_counter() - started
    finally:
        deleted = core.delete_namespaced_pod(name, namespace, grace_period_seconds=1)
        _watch_until(
            core, namespace, name, deleted.metadata.resource_version, lambda k, p: k == "DELETED"
        )
    return ended, time.perf_counter() - started


def bench_kubernetes(b: Bench) -> list[Row]:
    from kubernetes import client

    from sandbox.backends.kubernetes.backend import KubernetesBackend
    from sandbox.backends.kubernetes.podrun import connect

    n = b.sizes.startup_n
    with cluster_target(b) as target:
        settings = target.settings
        wf = write_workflow(target.work / "noop", name="noop", step="noop", command=["true"])
        api = connect(settings)
        core = client.CoreV1Api(api)

        def pods() -> KubernetesBackend:
            return KubernetesBackend.connect(settings)

        def test_run() -> tuple[float, TestRunRecord]:
            t = time.perf_counter()
            record = TestRun(wf, "noop", backend=pods).execute()
            wall = time.perf_counter() - t
            if record.status is not RunStatus.PASSED:
                status = record.status.value
                raise BenchError(f"no-op run on the cluster ended {status}: {record.reason}")
            return wall, record

        fleet = target.fleet
        fleet_wf = noop_workflow(fleet, f"bench-fleet-{b.bench_id[-8:]}") if fleet else None

        def fleet_run() -> float:
            if fleet is None or fleet_wf is None:
                raise BenchError("no fleet to place runs on")
            return fleet_run_s(core, fleet, fleet_wf)

        try:
            b.say("kubernetes: warm-up (one of each, not counted)")
            test_run()
            bare_pod_s(core, settings, b.bench_id, 0)
            if fleet is not None:
                fleet_run()
            runs: list[tuple[float, TestRunRecord]] = []
            bare: list[tuple[float, float]] = []
            fleet_runs: list[float] = []
            for i in range(n):
                b.say(f"kubernetes: round {i + 1}/{n}")
                runs.append(test_run())
                bare.append(bare_pod_s(core, settings, b.bench_id, i + 1))
                if fleet is not None:
                    fleet_runs.append(fleet_run())
        finally:
            api.close()
    run_med = statistics.median(w for w, _ in runs)
    wall, mid = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    b.note(f"kubernetes, median no-op run on {target.label}: {PhaseBreakdown.of(mid, wall).text()}")
    rows = [
        make_row(
            "kubernetes_startup",
            "start-up on a cluster: no-op test run as a Pod",
            "s",
            run_med,
            statistics.median(gone for _, gone in bare),
            Goal(),
            baseline_name="bare one-container Pod, created to gone",
            note=f"median of {n}, {target.label}",
        )
    ]
    figure = "start-up on a cluster: no-op run placed by the scheduler (submit to record read)"
    if fleet is None:
        why = "the host config's cluster has no scheduler placement (placement = 'scheduler')"
        rows.append(status_row(FLEET_ROW, figure, "not measured", why))
        return rows
    landed = ", ".join(sorted(fleet.nodes)) or "?"
    rows.append(
        make_row(
            FLEET_ROW,
            figure,
            "s",
            statistics.median(fleet_runs),
            statistics.median(ended for ended, _ in bare),
            Goal(),
            baseline_name="bare `true` Pod, created to its container's end",
            note=f"median of {n}, {target.label}, runs landed on {landed}",
        )
    )
    return rows
