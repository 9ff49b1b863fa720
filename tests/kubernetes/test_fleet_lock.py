"""The normal run's shared lock on the fleet: Leases on the cluster, not a host's flock.

`sandbox lock --shared WF -- CMD` with the fleet's host config (`placement =
"scheduler"`) holds a shared Lease of its own while CMD runs: test runs placed on
either node are refused, other normal runs share it, and a holder that dies frees the
workflow once its Lease expires. The protocol (write, then check the other kind) is
`sandbox/backends/kubernetes/lease.spec.md`; the race test takes both kinds at the
same instant, many times.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from sandbox.backends.kubernetes import lease
from sandbox.contracts.errors import RefusedError
from sandbox.contracts.hostconfig import BackendConfig
from testbed.kubernetes.cluster import Cluster
from tests.conftest import write_workflow
from tests.kubernetes.fleetparts import RUN_DEADLINE_S, cli_host_config, only_schedulable, submit

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

RACE_ROUNDS = 40


@contextmanager
def _shared_holder(host: Path, wf: Path, owner: str) -> Iterator[subprocess.Popen[str]]:
    """`sandbox lock --shared` running CMD (`cat`, until its stdin closes), once CMD runs."""
    sandbox = str(Path(sys.executable).parent / "sandbox")
    argv = [sandbox, "lock", "--shared", str(wf), "--host-config", str(host), "--owner", owner]
    proc = subprocess.Popen(
        [*argv, "--", "sh", "-c", "echo held; exec cat"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "held\n", (line, proc.wait(), proc.stderr and proc.stderr.read())
        yield proc
    finally:
        if proc.poll() is None and proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()


def _shared_leases(api: Any, namespace: str) -> list[Any]:
    return [
        x
        for x in client.CoordinationV1Api(api).list_namespaced_lease(namespace).items
        if (x.metadata.labels or {}).get(lease.LABEL_SHARED_OF)
    ]


def _workflow(settings: BackendConfig) -> Path:
    assert settings.claim_root is not None
    return write_workflow(Path(settings.claim_root), db_sql=None)


def test_shared_holders_coexist_and_keep_test_runs_out_on_either_node(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """Two `sandbox lock --shared` hold the workflow at once; a test run placed on the
    first node, then one on the second, is refused naming them; once both ended their
    Leases are gone and the workflow's exclusive Lease can be taken."""
    wf = _workflow(fleet_settings)
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings)
    namespace = fleet_settings.namespace
    with (
        _shared_holder(host, wf, "nightly import") as first,
        _shared_holder(host, wf, "ad-hoc report") as second,
    ):
        assert len(_shared_leases(kube_api, namespace)) == 2
        for node in kube_cluster.node_names:
            with only_schedulable(kube_core, node, kube_cluster.node_names):
                run = submit(kube_cluster, fleet_settings, wf, "step1")
                assert run.wait(RUN_DEADLINE_S)
            assert run.node == node
            with pytest.raises(RefusedError, match=r"nightly import|ad-hoc report"):
                run.record()
            run.delete()
            run.close()
        assert first.poll() is None and second.poll() is None
    assert (first.returncode, second.returncode) == (0, 0)
    assert _shared_leases(kube_api, namespace) == []
    assert not (wf / "runs").exists() or not list((wf / "runs").glob("test-*"))
    taker = lease.WorkflowLease(kube_api, namespace, "wf", "the next test run")
    taker.acquire()
    taker.release()


def test_a_dead_shared_holders_lease_expires(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_api: Any,
    fleet_settings: BackendConfig,
) -> None:
    """The wrapper killed outright (SIGKILL) stops renewing its Lease: a test run is
    refused while the Lease is live and takes the workflow once it expired."""
    wf = _workflow(fleet_settings)
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings)
    namespace = fleet_settings.namespace
    with _shared_holder(host, wf, "killed holder") as holder:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        taker = lease.WorkflowLease(kube_api, namespace, "wf", "the next test run")
        with pytest.raises(RefusedError, match="killed holder"):
            taker.acquire()
        deadline = time.monotonic() + 3 * lease.LEASE_DURATION_S
        while True:
            try:
                taker.acquire()
                break
            except RefusedError:
                assert time.monotonic() < deadline, "the dead holder's Lease never expired"
                time.sleep(0.5)
        assert _shared_leases(kube_api, namespace) == []  # the dead one removed
        taker.release()
    # CMD (`cat`) outlived its wrapper: its stdin closed, it ends.


def test_shared_and_exclusive_taken_at_the_same_instant_never_both_get_in(
    kube_cluster: Cluster,
    kube_api: Any,
    fleet_settings: BackendConfig,
) -> None:
    """A normal run's share and a test run's Lease taken at once, many times, through
    two API clients: never both held; the workflow's Leases gone after each round."""
    namespace = fleet_settings.namespace
    apis = [kube_cluster.api_client(), kube_cluster.api_client()]
    held_both = []
    winners: dict[str, int] = {"shared": 0, "exclusive": 0}
    try:
        for round_ in range(RACE_ROUNDS):
            shared = lease.SharedLease(apis[0], namespace, "wf", f"normal run {round_}")
            exclusive = lease.WorkflowLease(apis[1], namespace, "wf", f"test run {round_}")
            got: dict[str, bool] = {}
            start = threading.Barrier(2)

            def take(
                kind: str,
                taker: Any,
                got: dict[str, bool] = got,
                start: threading.Barrier = start,
            ) -> None:
                start.wait(timeout=30)
                try:
                    taker.acquire()
                    got[kind] = True
                except RefusedError:
                    got[kind] = False

            threads = [
                threading.Thread(target=take, args=("shared", shared)),
                threading.Thread(target=take, args=("exclusive", exclusive)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert set(got) == {"shared", "exclusive"}, got
            if got["shared"] and got["exclusive"]:
                held_both.append(round_)
            for kind, taker in (("shared", shared), ("exclusive", exclusive)):
                if got[kind]:
                    winners[kind] += 1
                    taker.release()
            assert client.CoordinationV1Api(apis[0]).list_namespaced_lease(namespace).items == []
    finally:
        for api in apis:
            api.close()
    assert held_both == []
    assert winners["shared"] + winners["exclusive"] > 0, winners
