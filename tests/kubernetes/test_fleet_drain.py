"""A fleet node drained mid-run: `kubectl drain` through the API, as it does it.

Drain cordons the node and asks the Eviction API to evict every Pod on it, retrying
while a disruption budget refuses, until none is left. The run's Pods have a budget
that refuses (`fleet.run_pod_budget`); the runner's Pod has none: evicted, its
runner gets SIGTERM, ends the run `killed` and deletes the run's Pod itself, and the
drain completes. The workflow is free again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.record import RunStatus, read_record
from testbed.kubernetes.cluster import Cluster
from tests.kubernetes.fleetparts import (
    RUN_DEADLINE_S,
    cli_host_config,
    hold_workflow,
    leases_of,
    only_schedulable,
    step_running_on,
    submit,
    the_run,
)
from tests.kubernetes.pods import loops_of, no_pods_or_secrets, node_mounts_of

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]


def _evict(core: Any, namespace: str, name: str) -> str:
    """One eviction through the Eviction API: `evicted`, `refused` (429: a budget) or `gone`."""
    # policy/v1beta1: the local cluster's Kubernetes (1.20), as its kubectl drain sends it
    body = client.V1Eviction(
        api_version="policy/v1beta1",
        kind="Eviction",
        metadata=client.V1ObjectMeta(name=name, namespace=namespace),
    )
    try:
        core.create_namespaced_pod_eviction(name, namespace, body)
    except ApiException as exc:
        if exc.status == 429:
            return "refused"
        if exc.status == 404:
            return "gone"
        raise
    return "evicted"


def _drain(core: Any, namespace: str, node: str, first: str) -> list[tuple[str, str]]:
    """`kubectl drain` of the node for this namespace's Pods (cordoned by the caller):
    `first` asked first, then every Pod on the node, again while any is left."""
    seen: list[tuple[str, str]] = [(first, _evict(core, namespace, first))]
    deadline = time.monotonic() + RUN_DEADLINE_S
    while True:
        left = core.list_namespaced_pod(namespace, field_selector=f"spec.nodeName={node}").items
        if not left:
            return seen
        assert time.monotonic() < deadline, f"the drain never ended: {seen[-5:]}"
        for pod in left:
            if pod.metadata.deletion_timestamp is None:
                seen.append((pod.metadata.name, _evict(core, namespace, pod.metadata.name)))
        time.sleep(1.0)  # kubectl drain's retry interval is 5 s


def _lock_shared(host: Path, wf: Path) -> subprocess.CompletedProcess[str]:
    """A normal run of the workflow: `sandbox lock --shared` with the fleet's host config."""
    sandbox = str(Path(sys.executable).parent / "sandbox")
    argv = [sandbox, "lock", "--shared", str(wf), "--host-config", str(host), "--json"]
    return subprocess.run(
        [*argv, "--", "true"], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_node_drained_mid_run_ends_it_killed_and_frees_the_workflow(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_core: Any,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """While the step runs on the second node, a normal run's shared lock is refused
    (exit 3, naming the runner). The node is drained, the run's own Pod asked first:
    its budget refuses it; the runner's Pod is evicted; the record ends `killed`,
    never `passed`; the run's Pod, Secret, Lease and mounts go; the drain ends; a
    normal run then takes the workflow."""
    assert fleet_settings.claim_root is not None
    wf = hold_workflow(Path(fleet_settings.claim_root))
    node = kube_cluster.node_names[1]
    namespace = fleet_settings.namespace
    with only_schedulable(kube_core, node, kube_cluster.node_names):
        run = submit(kube_cluster, fleet_settings, wf, "step1")
        run_pod = step_running_on(kube_core, namespace, node, run)
    runner = run._pod()
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings)
    refused = _lock_shared(host, wf)
    assert refused.returncode == 3, (refused.stdout, refused.stderr)
    error = json.loads(refused.stderr.splitlines()[-1])
    assert runner.metadata.name in json.dumps(error), error

    kube_core.patch_node(node, {"spec": {"unschedulable": True}})
    try:
        evictions = _drain(kube_core, namespace, node, first=run_pod.metadata.name)
    finally:
        kube_core.patch_node(node, {"spec": {"unschedulable": False}})
    assert evictions[0] == (run_pod.metadata.name, "refused"), evictions
    assert (runner.metadata.name, "evicted") in evictions, evictions

    assert run.wait(RUN_DEADLINE_S)
    record = run.record()
    assert record.status is RunStatus.KILLED, (record.status, record.reason)
    assert read_record(the_run(wf)).status is RunStatus.KILLED  # one run, never repeated
    run.delete()
    run.close()
    no_pods_or_secrets(kube_core, namespace)
    assert leases_of(kube_api, namespace) == []
    assert node_mounts_of(kube_cluster, node, record.id) == []
    deadline = time.monotonic() + RUN_DEADLINE_S
    while loops_of(record.id):
        assert time.monotonic() < deadline, loops_of(record.id)
        time.sleep(0.2)
    taken = _lock_shared(host, wf)
    assert taken.returncode == 0, (taken.stdout, taken.stderr)
