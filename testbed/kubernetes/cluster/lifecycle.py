"""Starting a cluster in order (credentials, control plane, nodes, images), and finding orphans.

A start that fails stops what it started; a cluster whose owner process is gone
(a killed test session) is stopped by the next start().
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

from testbed.kubernetes.cluster import credentials
from testbed.kubernetes.cluster.binaries import ensure_binaries
from testbed.kubernetes.cluster.controlplane import ControlPlane
from testbed.kubernetes.cluster.images import Images, pause_image_archive
from testbed.kubernetes.cluster.node import Nodes
from testbed.kubernetes.cluster.state import (
    CLUSTERS_DIR,
    NODE_NAME,
    PAUSE_IMAGE,
    SECOND_NODE_NAME,
    UNIX_PATH_MAX,
    ClusterError,
    ClusterState,
    ExtraNode,
    Ports,
    me,
    node_ready,
    process_alive,
)
from testbed.kubernetes.cluster.teardown import Teardown
from testbed.ports import free_ports


class Cluster(Teardown, Nodes, ControlPlane, Images):
    """One running cluster; see the package docstring for what it guarantees."""

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @classmethod
    def start(
        cls,
        *,
        images: tuple[str, ...] = (),
        parent: Path = CLUSTERS_DIR,
        pod_subnet: str = "10.213.0.0/24",
        pod_pids_limit: int = 1024,
        image_store_size: str = "4g",
        nodes: int = 1,
        detached: bool = False,
        log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
    ) -> Cluster:
        """Build (once), start and wait for a Ready node; on any failure stop what started.

        The cluster belongs to this process unless `detached`; clusters of dead owners
        (a killed test session) in `parent` are stopped first."""
        if os.geteuid() != 0:
            raise ClusterError("the local cluster needs root (cgroups, namespaces, mounts)")
        if nodes not in (1, 2):
            raise ClusterError(f"a local cluster has one or two nodes, not {nodes}")
        t0 = time.monotonic()
        for stale in stop_orphans(parent):
            log(f"cluster: stopped {stale}, left by a process that is gone")
        bin_root = ensure_binaries()
        log(f"cluster: binaries ready in {time.monotonic() - t0:.1f} s ({bin_root})")
        cid = secrets.token_hex(3)
        directory = parent / cid
        directory.mkdir(parents=True, mode=0o700)
        sock = directory / "containerd" / "containerd.sock"
        longest = directory / "node2" / "containerd" / "containerd.sock"
        if len(str(longest)) + len(".ttrpc") > UNIX_PATH_MAX:
            shutil.rmtree(directory)
            raise ClusterError(f"{directory} is too long a path for containerd's sockets")
        names = list(Ports.model_fields)
        picked = free_ports(len(names) + 2 * (nodes - 1))
        ports = Ports(**dict(zip(names, picked, strict=False)))
        extra = [
            ExtraNode(
                name=SECOND_NODE_NAME,
                kubelet_port=picked[len(names)],
                healthz_port=picked[len(names) + 1],
                folder=directory / "node2",
                containerd_socket=directory / "node2" / "containerd" / "containerd.sock",
                cgroup_root=f"/sandbox-k8s-{cid}-node2",
            )
            for _ in range(nodes - 1)
        ]
        state = ClusterState(
            id=cid,
            directory=directory,
            bin_dir=bin_root / "bin",
            # An IP as the node's name is what gives the node the InternalIP 127.0.0.1:
            # the kubelet refuses a loopback --node-ip, and the apiserver reaches the
            # kubelet (logs, exec) at the node's InternalIP.
            node_name=NODE_NAME,
            bridge=f"sk8s{cid}",
            pod_subnet=pod_subnet,
            cgroup_root=f"/sandbox-k8s-{cid}",
            ports=ports,
            kubeconfig=directory / "admin.kubeconfig",
            containerd_socket=sock,
            seccomp_root=directory / "seccomp",
            admin_token=secrets.token_urlsafe(24),
            image_store_size=image_store_size,
            extra_nodes=extra,
            owner=None if detached else me(),
        )
        cluster = cls(state)
        cluster._save()
        try:
            cluster._start_all(bin_root, images, pod_pids_limit, log)
        except BaseException:
            cluster.stop(keep=True)
            raise
        ready_s = time.monotonic() - t0
        log(f"cluster: {', '.join(cluster.node_names)} Ready in {ready_s:.1f} s ({directory})")
        return cluster

    def _start_all(
        self,
        bin_root: Path,
        images: tuple[str, ...],
        pod_pids_limit: int,
        log: Callable[[str], None],
    ) -> None:
        s, bin_dir = self.state, self.state.bin_dir
        t0 = time.monotonic()
        c = credentials.issue(s)
        log(f"cluster: keys and certificates in {time.monotonic() - t0:.1f} s")
        cm, scheduler = self._start_control_plane(c, log, t0)

        self._make_cgroup_root()
        self._share_node_storage()
        self._start_namespaces()
        self._start_node_namespaces()
        runtimes = [(s.containerd_socket, self._start_containerd(bin_root))]
        runtimes += [
            (n.containerd_socket, self._start_containerd(bin_root, n)) for n in s.extra_nodes
        ]
        archive = pause_image_archive(bin_dir / "pause", PAUSE_IMAGE)
        for sock, containerd in runtimes:
            ctr_ok = partial(
                lambda k: self.ctr("version", check=False, socket=k).returncode == 0, sock
            )
            self._wait_up(containerd, containerd.name, ctr_ok, 30)
            imported = self.ctr("images", "import", "-", input=archive, check=False, socket=sock)
            if imported.returncode != 0:
                raise ClusterError(
                    f"importing the pause image failed: {imported.stderr.decode()[-500:]}"
                )
        log(f"cluster: containerd up at {time.monotonic() - t0:.1f} s")

        s.seccomp_root.mkdir()
        kubelet = self._start_kubelet(*c.kubelet, c.ca, pod_pids_limit)
        kubelets = [(s.node_name, kubelet)]
        for node, (crt, key) in zip(s.extra_nodes, c.extra_kubelets, strict=True):
            kubelets.append((node.name, self._start_kubelet(crt, key, c.ca, pod_pids_limit, node)))

        # The images load while the kubelet registers the node.
        load_error: list[BaseException] = []

        def load() -> None:
            try:
                if images:
                    self.load_docker_images(*images)
            except BaseException as e:
                load_error.append(e)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        for name, daemon in kubelets:
            self._wait_node_ready(daemon, 120, name)
        log(f"cluster: {len(kubelets)} node(s) Ready at {time.monotonic() - t0:.1f} s")
        self._wait_control_plane(c, cm, scheduler)
        loader.join()
        if load_error:
            raise load_error[0]
        log(f"cluster: images {images} loaded at {time.monotonic() - t0:.1f} s")

    @classmethod
    def attach(cls, directory: Path) -> Cluster:
        """The cluster whose `state.json` is in `directory` (running, half-started or dead)."""
        return cls(ClusterState.model_validate_json((directory / "state.json").read_text()))

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "directory": str(self.state.directory),
            "kubeconfig": str(self.state.kubeconfig),
            "nodes": self.node_names,
            "daemons": {
                x.name: {"pid": x.pid, "alive": self._alive(x)} for x in self.state.daemons
            },
        }
        try:
            from kubernetes import client

            with self.api_client() as api:
                core = client.CoreV1Api(api)
                out["ready"] = all(
                    node_ready(core.read_node(n, _request_timeout=3)) for n in self.node_names
                )
        except Exception as e:
            out["ready"] = f"unknown ({type(e).__name__})"
        return out


def running_clusters(parent: Path = CLUSTERS_DIR) -> list[Path]:
    """The folders of this checkout's clusters (running, half-started or dead)."""
    return sorted(p.parent for p in parent.glob("*/state.json"))


def stop_orphans(parent: Path = CLUSTERS_DIR) -> list[Path]:
    """Stop the clusters whose owner process is gone; returns their folders."""
    stopped = []
    for directory in running_clusters(parent):
        try:
            cluster = Cluster.attach(directory)
        except (OSError, ValueError):
            continue
        owner = cluster.state.owner
        if owner is not None and not process_alive(owner.pid, owner.started):
            cluster.stop()
            stopped.append(directory)
    return stopped


@contextlib.contextmanager
def running(**kwargs: Any) -> Iterator[Cluster]:
    """A cluster for the duration of a `with` block; stopped whatever happens inside."""
    cluster = Cluster.start(**kwargs)
    try:
        yield cluster
    finally:
        cluster.stop()
