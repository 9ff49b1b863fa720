"""What a cluster is on disk (`state.json`), its constants, and polling with a deadline.

`ClusterState` holds everything stop() needs, so a cluster can be stopped from its
folder alone (after a killed test session); a daemon is known by pid and start time,
so a reused pid is never signalled.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from pydantic import BaseModel

from sandbox.resources import seccomp_dir
from testbed.paths import REPO

REPO_ROOT = REPO
CLUSTERS_DIR = REPO_ROOT / "build" / "kubernetes-clusters"
SECCOMP_DIR = seccomp_dir()
PAUSE_IMAGE = "localhost/sandbox-pause:3.2"
NODE_NAME = "127.0.0.1"
SECOND_NODE_NAME = "127.0.0.2"  # the whole of 127.0.0.0/8 is the host's loopback
CGROUP_MOUNT = Path("/sys/fs/cgroup")
# What the kubelet writes under /proc/sys when it differs from what it wants.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
# Host paths containerd, the CNI library and the kubelet write to whatever they are told.
PRIVATE_PATHS = ("/var/log", "/var/lib/cni", "/run/containerd")
CREATED_XATTR = "trusted.sandbox-test-cluster"
# How long the host may take to unmount the node storage once the cluster is stopped
# (what the killed processes held is dropped as they are reaped).
UNMOUNT_DEADLINE_S = 30.0
UNIX_PATH_MAX = 107


class ClusterError(RuntimeError):
    """The cluster did not come up (the message names the part and its log)."""


class Daemon(BaseModel):
    name: str
    pid: int
    started: float  # psutil create_time: a pid whose start time differs is someone else's
    log: Path


class Ports(BaseModel):
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kubelet: int
    kubelet_healthz: int


class ExtraNode(BaseModel):
    """A node beyond the first: its own kubelet and containerd on the same control plane."""

    name: str  # an IP, as the first node's: it is the node's InternalIP
    kubelet_port: int
    healthz_port: int
    folder: Path  # its kubelet's and containerd's state, under the cluster's folder
    containerd_socket: Path
    cgroup_root: str  # beside the first node's (a kubelet starting reads its root's children)
    # Its kubelet and containerd share a mount namespace of their own (a slave of the
    # nodes' one) with its own /var/log: a kubelet deletes every /var/log/pods folder
    # of a Pod it does not know (its log garbage collection), so two kubelets sharing
    # one /var/log would delete each other's Pods' logs.
    mount_ns: str | None = None


class ClusterState(BaseModel):
    """Everything stop() needs, on disk in the cluster's folder."""

    id: str
    directory: Path
    bin_dir: Path
    node_name: str
    bridge: str
    pod_subnet: str
    cgroup_root: str
    ports: Ports
    daemons: list[Daemon] = []
    mount_ns: str | None = None
    net_ns: str | None = None
    created_paths: list[str] = []
    # A folder of the host whose later mounts the node sees (see share_node_storage).
    node_storage: Path | None = None
    kubeconfig: Path
    containerd_socket: Path
    seccomp_root: Path
    admin_token: str
    image_store_size: str
    extra_nodes: list[ExtraNode] = []
    # The process the cluster lives for (a test session); None for `up`, which lives
    # until `down`. A cluster whose owner is gone is stopped by the next start().
    owner: Daemon | None = None


def wait_for(
    what: str, check: Callable[[], bool], deadline_s: float, log: Path | None = None
) -> None:
    """Poll `check` until it holds, or raise with the tail of the part's log."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            if check():
                return
        except ClusterError:
            raise
        except Exception:
            pass
        if time.monotonic() >= end:
            tail = f"\n{log_tail(log)}" if log is not None else ""
            raise ClusterError(f"{what} not ready after {deadline_s:.0f} s{tail}")
        time.sleep(0.1)


def log_tail(log: Path, lines: int = 25) -> str:
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def answers_ok(http: httpx.Client, url: str) -> bool:
    return http.get(url).text == "ok"


def node_ready(node: Any) -> bool:
    conditions = node.status.conditions if node.status else None
    return any(c.type == "Ready" and c.status == "True" for c in conditions or [])


def me() -> Daemon:
    return Daemon(name="owner", pid=os.getpid(), started=psutil.Process().create_time(), log=Path())


def process_alive(pid: int, started: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
