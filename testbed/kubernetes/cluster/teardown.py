"""Stopping a cluster from its `state.json` alone, and removing all it made.

Processes are killed by identity (the nodes' cgroup roots, frozen first; members of
the private namespaces), never by name; then the cgroup roots, the marked mount
points and the folder go, and a mount left behind is an error, never ignored.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from functools import partial
from pathlib import Path

import psutil

from testbed.kubernetes.cluster.hostinfo import (
    cgroup_hierarchies,
    mounted_anywhere,
    mounts_under,
    ns_id,
    procs_in_cgroup_tree,
)
from testbed.kubernetes.cluster.namespaces import NodeHost
from testbed.kubernetes.cluster.state import (
    CGROUP_MOUNT,
    CREATED_XATTR,
    PRIVATE_PATHS,
    ClusterError,
    Daemon,
    wait_for,
)


class Teardown(NodeHost):
    def stop(self, *, keep: bool = False) -> list[str]:
        """Stop everything and remove what the cluster made; returns what could not be removed.

        `keep=True` leaves the cluster's folder (its logs) for a post-mortem; everything
        else goes either way. Raises if something outside the folder is left."""
        s = self.state
        by_name = {x.name: x for x in s.daemons}
        # The kubelets first, so nothing restarts what is killed next.
        extra = [n.name for n in s.extra_nodes]
        kubelets = ["kubelet", *(f"kubelet-{n}" for n in extra)]
        self._terminate([by_name[n] for n in kubelets if n in by_name], 10)
        self._kill_cgroup_tree()
        order = [
            "containerd",
            *(f"containerd-{n}" for n in extra),
            "kube-scheduler",
            "kube-controller-manager",
            "kube-apiserver",
            "etcd",
        ]
        self._terminate([by_name[n] for n in order if n in by_name], 10)
        self._kill_namespace_members()
        holders = [d for n, d in by_name.items() if n.startswith("namespaces-")]
        if "namespaces" in by_name:
            holders.append(by_name["namespaces"])
        if holders:
            self._terminate(holders, 5)
        problems = self._unshare_node_storage()
        problems += self._remove_cgroup_root()
        problems += self._remove_created_paths()
        mounts = mounts_under(s.directory)
        if mounts:
            problems.append(f"mounts left under the cluster folder: {mounts}")
        elif not keep:
            shutil.rmtree(s.directory, ignore_errors=True)
        if problems:
            raise ClusterError("the cluster did not stop cleanly: " + "; ".join(problems))
        return problems

    def _terminate(self, daemons: list[Daemon], deadline_s: float) -> None:
        procs = []
        for daemon in daemons:
            if self._alive(daemon):
                proc = psutil.Process(daemon.pid)
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.terminate()
                    procs.append(proc)
        _gone, alive = psutil.wait_procs(procs, timeout=deadline_s)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)

    def _cgroup_roots(self) -> list[Path]:
        names = [self.state.cgroup_root, *(n.cgroup_root for n in self.state.extra_nodes)]
        return [
            h / name.lstrip("/")
            for name in names
            for h in cgroup_hierarchies()
            if (h / name.lstrip("/")).is_dir()
        ]

    def _kill_cgroup_tree(self) -> None:
        """Kill every process in the nodes' cgroup roots (the containers), frozen first."""
        names = [self.state.cgroup_root, *(n.cgroup_root for n in self.state.extra_nodes)]
        frozen = []
        for name in names:
            freezer = CGROUP_MOUNT / "freezer" / name.lstrip("/")
            if (freezer / "freezer.state").exists():
                with contextlib.suppress(OSError):
                    (freezer / "freezer.state").write_text("FROZEN")
                    frozen.append(freezer)
                    state = freezer / "freezer.state"
                    wait_for(
                        "freezing the cluster's cgroup",
                        partial(lambda f: f.read_text().strip() == "FROZEN", state),
                        10,
                    )
        pids: set[int] = set()
        for root in self._cgroup_roots():
            pids |= procs_in_cgroup_tree(root)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for freezer in frozen:
            with contextlib.suppress(OSError):
                (freezer / "freezer.state").write_text("THAWED")
        wait_for(
            "the cluster's containers to exit",
            lambda: not any(procs_in_cgroup_tree(r) for r in self._cgroup_roots()),
            15,
        )

    def _namespace_members(self) -> list[int]:
        ours = {x for x in (self.state.mount_ns, self.state.net_ns) if x}
        ours |= {n.mount_ns for n in self.state.extra_nodes if n.mount_ns}
        holders = {x.pid for x in self.state.daemons if x.name.startswith("namespaces")}
        members = []
        for pid in psutil.pids():
            if pid in holders:
                continue
            try:
                if ns_id(pid, "mnt") in ours or ns_id(pid, "net") in ours:
                    members.append(pid)
            except OSError:
                continue
        return members

    def _kill_namespace_members(self) -> None:
        """Kill what the daemons left in the private namespaces (the containerd shims)."""
        if not (self.state.mount_ns or self.state.net_ns):
            return
        for pid in self._namespace_members():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for("the cluster's shims to exit", lambda: not self._namespace_members(), 15)

    def _remove_cgroup_root(self) -> list[str]:
        problems = []
        for root in self._cgroup_roots():
            for dirpath, _dirs, _files in os.walk(root, topdown=False):
                try:
                    os.rmdir(dirpath)
                except OSError as e:
                    problems.append(f"cgroup {dirpath}: {e}")
        return problems

    def _remove_created_paths(self) -> list[str]:
        """Remove marked mount points no cluster uses any more (deepest first)."""
        problems = []
        for path in sorted(
            set(self.state.created_paths) | set(PRIVATE_PATHS), key=len, reverse=True
        ):
            p = Path(path)
            try:
                marked = os.getxattr(p, CREATED_XATTR) == b"1"
            except OSError:
                continue
            if not marked or mounted_anywhere(path):
                continue
            try:
                p.rmdir()
            except OSError as e:
                problems.append(f"{path}: {e}")
        return problems
