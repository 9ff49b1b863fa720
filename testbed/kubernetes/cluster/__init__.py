"""A real Kubernetes cluster of one or two nodes on this host, on loopback and private state only.

`Cluster.start()` builds (once, cached) and starts etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, and per node a private containerd with CRI
and a kubelet; `Cluster.stop()` takes all of it down again. A second node
(`nodes=2`) is a second kubelet named `127.0.0.2` (its InternalIP, a loopback
address of its own) with its own root folder, containerd (config, socket, state,
image store), certificate, token and cgroup root;
both share the control plane, the private namespaces and the pod bridge, so Pods on
either node reach each other and both kubelets see the shared node storage. As a context manager:

    with Cluster.start(images=("sandbox-step:current",)) as cluster:
        with cluster.api_client() as api:   # kubernetes.client.ApiClient, admin token
            ...                             # or cluster.kubeconfig for anything else

For humans: `python -m testbed.kubernetes.cluster up|down|status` (cli.py).

The parts, by concern: `state` (what `state.json` holds), `binaries` (the cached
build), `credentials` (CA, certificates, tokens, kubeconfigs), `controlplane`,
`namespaces` (cgroup roots, private namespaces, node storage), `node` (containerd
and kubelet), `images`, `teardown`, `lifecycle` (start in order, orphans), `cli`.

Guarantees, and how:
- Loopback only. Every listener binds 127.0.0.1 on a port picked free at start;
  etcd and the kubelet accept only certificates from the cluster's own CA; the
  apiserver accepts only the cluster's bearer tokens (RBAC + Node authorizer).
- No host setting changes. The kubelet wants to set vm.overcommit_memory,
  kernel.panic, kernel.panic_on_oops (and three more it may touch); containerd and
  the kubelet run in a private mount namespace (propagation slave) in which those
  /proc/sys files are bind-mounted from plain files of the cluster's folder. The
  same namespace gives them private /var/log (pod logs), /var/lib/cni (the CNI
  result cache) and /run/containerd (shim sockets), so nothing they write lands
  on the host. No iptables rule anywhere on the host: the kubelet's chains are
  off, and the pod bridge (`isGateway: false`, `ipMasq: false`, no host IP) lives
  in a private network namespace held by the same process, so neither the host's
  interfaces nor its netfilter see pod traffic (Docker's FORWARD policy DROP with
  br_netfilter would otherwise drop bridged pod-to-pod frames).
- Everything started is tracked by pid (with its start time, so a reused pid is
  never signalled) in `state.json`; stop() also kills what the daemons left
  behind, found by identity, not by name: processes in the cluster's cgroup root
  (frozen first, then killed) and processes in its mount or network namespace
  (the containerd shims). The namespaces die with their last process, taking the
  bridge, the veths, the pod network namespaces and every container mount with
  them. stop() then removes the cgroup root from every hierarchy and the
  cluster's folder, and checks that no mount of it is left.
- stop() works from `state.json` alone, so `down` cleans up after a test run that
  was killed.

Limits: the ports are free when picked and taken a moment later (a race with
another program binding the same port fails start(), which then cleans up).
Host directories used as mount points (/var/lib/cni, /run/containerd) are created
when missing, marked with an extended attribute, and removed again by the last
cluster that stops while they are empty and unused.
"""

from testbed.kubernetes.cluster.binaries import BUILD_SCRIPT, ensure_binaries
from testbed.kubernetes.cluster.cli import main
from testbed.kubernetes.cluster.images import pause_image_archive
from testbed.kubernetes.cluster.lifecycle import Cluster, running, running_clusters, stop_orphans
from testbed.kubernetes.cluster.state import (
    CLUSTERS_DIR,
    KUBELET_SYSCTLS,
    NODE_NAME,
    PAUSE_IMAGE,
    PRIVATE_PATHS,
    REPO_ROOT,
    SECCOMP_DIR,
    SECOND_NODE_NAME,
    ClusterError,
    ClusterState,
    wait_for,
)

__all__ = [
    "BUILD_SCRIPT",
    "CLUSTERS_DIR",
    "KUBELET_SYSCTLS",
    "NODE_NAME",
    "PAUSE_IMAGE",
    "PRIVATE_PATHS",
    "REPO_ROOT",
    "SECCOMP_DIR",
    "SECOND_NODE_NAME",
    "Cluster",
    "ClusterError",
    "ClusterState",
    "ensure_binaries",
    "main",
    "pause_image_archive",
    "running",
    "running_clusters",
    "stop_orphans",
    "wait_for",
]
