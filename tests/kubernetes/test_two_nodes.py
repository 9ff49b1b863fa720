"""The local cluster's two nodes: both schedulable, both mount the shared storage.

The second node is a second kubelet with its own containerd on the same control
plane (`Cluster`, `nodes=2`). On one machine the ReadWriteMany volume both nodes
mount is a hostPath volume on the shared node storage, which both kubelets see:
the stand-in for the network file system a real fleet's claim would be.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from sandbox.backends import BackendFactory
from sandbox.contracts.record import RunStatus
from sandbox.run.testrun import TestRun
from testbed.kubernetes.cluster import Cluster
from tests.conftest import tree_digest, write_workflow
from tests.kubernetes.fleetparts import only_schedulable
from tests.kubernetes.pods import (
    OUTSIDE_PORT,
    locked_down,
    no_pods_or_secrets,
    outside_server_pod,
    small,
    start_server,
    watch_pod,
)

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

SHARED_UID = 10002  # the guard image's user: the writer of the shared folder


def test_the_cluster_has_two_ready_nodes_with_their_own_runtimes(
    kube_cluster: Cluster, kube_core: Any
) -> None:
    nodes = {n.metadata.name: n for n in kube_core.list_node().items}
    assert sorted(nodes) == ["127.0.0.1", "127.0.0.2"]
    for name, node in nodes.items():
        addresses = {a.type: a.address for a in node.status.addresses}
        assert addresses["InternalIP"] == name
        assert not node.spec.unschedulable
        assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)
    (second,) = kube_cluster.state.extra_nodes
    assert second.containerd_socket != kube_cluster.state.containerd_socket
    assert second.cgroup_root != kube_cluster.state.cgroup_root
    for root in (kube_cluster.state.cgroup_root, second.cgroup_root):
        assert Path("/sys/fs/cgroup/pids", root.lstrip("/"), "kubepods").is_dir()
    # Each runtime holds the images the runs need, loaded into it.
    for sock in (kube_cluster.state.containerd_socket, second.containerd_socket):
        listed = kube_cluster.ctr("images", "ls", "-q", socket=sock).stdout.decode()
        assert "sandbox-step" in listed and "sandbox-guard" in listed


def _writer_pod(name: str, node: str, claim_name: str, sub: str) -> dict[str, Any]:
    """A Pod pinned to `node` that writes `from-<node>` into the claim's `sub` folder and
    waits (bounded) until the other node's file is there too."""
    pod = outside_server_pod()
    pod["metadata"]["name"] = name
    pod["spec"]["nodeName"] = node
    mine = f"/shared/from-{node}"
    script = (
        "import os, time\n"
        f"open({mine!r}, 'w').write({node!r})\n"
        "deadline = time.monotonic() + 120\n"
        "while len([n for n in os.listdir('/shared') if n.startswith('from-')]) < 2:\n"
        "    assert time.monotonic() < deadline, os.listdir('/shared')\n"
        "    time.sleep(0.05)\n"
        "print(sorted(os.listdir('/shared')), flush=True)\n"
    )
    pod["spec"]["containers"][0].update(
        {
            "command": ["python3", "-c", script],
            "securityContext": locked_down(SHARED_UID),
            "resources": small(),
            "volumeMounts": [{"name": "shared", "mountPath": "/shared", "subPath": sub}],
        }
    )
    pod["spec"]["volumes"] = [
        {"name": "shared", "persistentVolumeClaim": {"claimName": claim_name}}
    ]
    return pod


def test_both_nodes_mount_the_read_write_many_claim(
    kube_cluster: Cluster,
    kube_core: Any,
    kube_namespace: str,
    claim: tuple[str, Path],
) -> None:
    claim_name, root = claim
    shared = root / "shared"
    shared.mkdir()
    os.chown(shared, SHARED_UID, SHARED_UID)
    made = []
    for i, node in enumerate(kube_cluster.node_names):
        pod = _writer_pod(f"writer-{i}", node, claim_name, "shared")
        made.append(kube_core.create_namespaced_pod(kube_namespace, pod))
    for created in made:
        ended = watch_pod(
            kube_core,
            kube_namespace,
            created.metadata.name,
            created.metadata.resource_version,
            lambda p: p.status.phase == "Succeeded",
        )
        assert ended.spec.node_name == created.spec.node_name
    # Each Pod saw the other node's file; the runner's side sees both.
    assert sorted(p.name for p in shared.iterdir()) == [
        f"from-{n}" for n in sorted(kube_cluster.node_names)
    ]
    # Each node keeps its Pods' logs in its own /var/log: a kubelet's log collection
    # deletes the log folders of every Pod it does not know, so on a shared /var/log
    # the first node's would delete the second's Pods' logs under them.
    first_var_log = kube_cluster.state.directory / "private" / "var-log"
    var_logs = {kube_cluster.state.node_name: first_var_log}
    var_logs |= {n.name: n.folder / "var-log" for n in kube_cluster.state.extra_nodes}
    for created in made:
        folder = f"{kube_namespace}_{created.metadata.name}_{created.metadata.uid}"
        node = kube_core.read_namespaced_pod(created.metadata.name, kube_namespace).spec.node_name
        holding = [n for n, var_log in var_logs.items() if (var_log / "pods" / folder).is_dir()]
        assert holding == [node], (folder, holding)
    for created in made:
        kube_core.delete_namespaced_pod(
            created.metadata.name, kube_namespace, grace_period_seconds=0
        )


def test_runs_land_on_whichever_node_the_scheduler_picks(
    kube_cluster: Cluster,
    kube_core: Any,
    kube_namespace: str,
    pods: BackendFactory,
    node_dir: Path,
) -> None:
    """No node named in the settings: with one node cordoned the scheduler places the
    run's Pod on the other, and the run passes there, for each node in turn."""
    wf = write_workflow(
        node_dir, command=["python3", "-c", "open('out.txt', 'w').write('done')"], db_sql=None
    )
    before = tree_digest(wf)
    landed = []
    for node in kube_cluster.node_names:
        with only_schedulable(kube_core, node, kube_cluster.node_names):
            record = TestRun(wf, "step1", backend=pods).execute()
        assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
        assert (wf / "runs" / record.id / "g" / "out.txt").read_text() == "done"
        landed.append(record.node)
    assert landed == kube_cluster.node_names
    assert tree_digest(wf) == before
    no_pods_or_secrets(kube_core, kube_namespace)


def test_a_pod_on_one_node_reaches_a_pod_on_the_other(
    kube_cluster: Cluster, kube_core: Any, kube_namespace: str
) -> None:
    """One pod bridge for both nodes: a run's upstream may be on either node."""
    first, second = kube_cluster.node_names
    server = outside_server_pod()
    server["spec"]["nodeName"] = second
    server_ip = start_server(kube_core, kube_namespace, server)
    client_pod = outside_server_pod()
    client_pod["metadata"]["name"] = "client"
    client_pod["spec"]["nodeName"] = first
    url = f"http://{server_ip}:{OUTSIDE_PORT}/"
    client_pod["spec"]["containers"][0]["command"] = [
        "python3",
        "-c",
        f"import urllib.request; urllib.request.urlopen({url!r}, timeout=20).read()",
    ]
    made = kube_core.create_namespaced_pod(kube_namespace, client_pod)
    ended = watch_pod(
        kube_core,
        kube_namespace,
        "client",
        made.metadata.resource_version,
        lambda p: p.status.phase == "Succeeded",
    )
    assert ended.spec.node_name == first
