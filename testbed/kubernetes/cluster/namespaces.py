"""The host side of the nodes: their cgroup roots, private namespaces and shared node storage.

containerd and the kubelets run in a private mount namespace (propagation slave) with
private /var/log, /var/lib/cni, /run/containerd and fake /proc/sys files, and a
private network namespace for the pod bridge: nothing they write lands on the host.
The node storage is a shared bind mount made before that namespace, so mounts made
under it on the host later reach the nodes.
"""

from __future__ import annotations

import os
import selectors
import subprocess
from pathlib import Path

import psutil

from testbed.kubernetes.cluster.base import ClusterBase
from testbed.kubernetes.cluster.hostinfo import (
    cgroup_hierarchies,
    holders_of,
    mounts_under,
    ns_id,
)
from testbed.kubernetes.cluster.state import (
    CREATED_XATTR,
    KUBELET_SYSCTLS,
    PRIVATE_PATHS,
    UNMOUNT_DEADLINE_S,
    ClusterError,
    Daemon,
    wait_for,
)


class NodeHost(ClusterBase):
    def _make_cgroup_root(self) -> None:
        roots = [self.state.cgroup_root, *(n.cgroup_root for n in self.state.extra_nodes)]
        for hierarchy in cgroup_hierarchies():
            if hierarchy.name == "unified":
                continue
            for name in roots:
                root = hierarchy / name.lstrip("/")
                root.mkdir(exist_ok=True)
                if (hierarchy / "cpuset.cpus").exists():
                    for knob in ("cpuset.cpus", "cpuset.mems"):
                        (root / knob).write_text((root.parent / knob).read_text())

    def _start_namespaces(self) -> None:
        """The holder of the private mount and network namespaces, set up before anything joins."""
        d = self.state.directory
        sysctl_dir = d / "sysctl"
        sysctl_dir.mkdir()
        lines = ["set -eu"]
        for name in KUBELET_SYSCTLS:
            host = Path("/proc/sys") / name
            if not host.exists():
                continue
            fake = sysctl_dir / name.replace("/", ".")
            fake.write_text(host.read_text())
            lines.append(f"mount --bind {fake} {host}")
        for path in PRIVATE_PATHS:
            self._ensure_mountpoint(Path(path))
            private = d / "private" / path.strip("/").replace("/", "-")
            private.mkdir(parents=True)
            lines.append(f"mount --bind {private} {path}")
        # containerd's image store and snapshots: a tmpfs only the namespace sees, so
        # loading images writes no disk and stopping frees them at once.
        for folder in [d, *(n.folder for n in self.state.extra_nodes)]:
            store = folder / "containerd" / "root"
            store.mkdir(parents=True)
            size = self.state.image_store_size
            lines.append(f"mount -t tmpfs -o size={size},mode=0700 sandbox-k8s {store}")
        # The node storage, a slave of the host's copy here, is made shared too (among
        # this namespace's mounts only): a Pod's `Bidirectional` mount of it (a fleet
        # runner's) needs a shared mount, and what it mounts reaches the other Pods'
        # volumes here, never the host.
        if self.state.node_storage is not None:
            lines.append(f"mount --make-shared {self.state.node_storage}")
        switch = d / "switch-netns"
        switch.touch()
        lines += [f"mount --bind /proc/self/ns/net {switch}", "echo ready", "exec sleep infinity"]
        log = d / "logs" / "namespaces.log"
        log.parent.mkdir(exist_ok=True)
        unshare = ["unshare", "--mount", "--propagation", "slave", "--net", "--"]
        with open(log, "ab") as err:
            proc = subprocess.Popen(
                [*unshare, "sh", "-c", "\n".join(lines)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
            )
        daemon = Daemon(
            name="namespaces", pid=proc.pid, started=psutil.Process(proc.pid).create_time(), log=log
        )
        self.state.daemons.insert(0, daemon)
        self._save()
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout=10) and proc.stdout.readline().strip() == b"ready"
        proc.stdout.close()
        if not ready:
            raise ClusterError(f"the private namespaces were not set up: {log.read_text()[-500:]}")
        self.state.mount_ns = ns_id(proc.pid, "mnt")
        self.state.net_ns = ns_id(proc.pid, "net")
        self._save()

    def _start_node_namespaces(self) -> None:
        """Each node beyond the first: a mount namespace of its own inside the nodes' one
        (propagation slave: it still receives the node storage's mounts), where its own
        folder is /var/log. Its kubelet and containerd join it (`_spawn(node=...)`)."""
        holder = next(x for x in self.state.daemons if x.name == "namespaces")
        for node in self.state.extra_nodes:
            var_log = node.folder / "var-log"
            var_log.mkdir(parents=True, exist_ok=True)
            lines = ["set -eu", f"mount --bind {var_log} /var/log"]
            if self.state.node_storage is not None:
                lines.append(f"mount --make-shared {self.state.node_storage}")
            lines += ["echo ready", "exec sleep infinity"]
            log = self.state.directory / "logs" / f"namespaces-{node.name}.log"
            enter = ["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", "--"]
            unshare = ["unshare", "--mount", "--propagation", "slave", "--"]
            with open(log, "ab") as err:
                proc = subprocess.Popen(
                    [*enter, *unshare, "sh", "-c", "\n".join(lines)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    start_new_session=True,
                )
            daemon = Daemon(
                name=f"namespaces-{node.name}",
                pid=proc.pid,
                started=psutil.Process(proc.pid).create_time(),
                log=log,
            )
            self.state.daemons.insert(1, daemon)
            self._save()
            assert proc.stdout is not None
            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout=10) and proc.stdout.readline().strip() == b"ready"
            proc.stdout.close()
            if not ready:
                raise ClusterError(
                    f"node {node.name}'s namespace was not set up: {log.read_text()[-500:]}"
                )
            node.mount_ns = ns_id(proc.pid, "mnt")
            self._save()

    def _share_node_storage(self) -> None:
        """A shared bind mount of the cluster's `node/` folder on the host, made before the
        node's mount namespace (propagation slave) copies the host's mounts: that copy
        receives every mount made under it on the host later, and nothing goes back."""
        storage = self.state.directory / "node"
        storage.mkdir(mode=0o755)
        subprocess.run(["mount", "--bind", str(storage), str(storage)], check=True)
        self.state.node_storage = storage
        self._save()
        subprocess.run(["mount", "--make-shared", str(storage)], check=True)

    def _unshare_node_storage(self) -> list[str]:
        storage = self.state.node_storage
        if storage is None or not mounts_under(storage):
            return []
        refused = ""

        def unmounted() -> bool:
            # A process killed a moment ago may still hold the mount's copy in its
            # namespace (the kernel drops it as the process is reaped), and a busy copy
            # anywhere in the propagation tree fails the host's umount with EBUSY: retry.
            nonlocal refused
            done = subprocess.run(
                ["umount", "--recursive", str(storage)],
                capture_output=True,
                text=True,
                check=False,
            )
            refused = done.stderr.strip()
            return done.returncode == 0 or not mounts_under(storage)

        try:
            wait_for("the node storage's unmount", unmounted, UNMOUNT_DEADLINE_S)
        except ClusterError:
            holders = "; ".join(holders_of(storage)) or "no process found holding it"
            return [f"node storage {storage} still mounted: {refused} (held by: {holders})"]
        return []

    def _ensure_mountpoint(self, path: Path) -> None:
        """Make `path` (and missing parents) if absent, marked so the last cluster removes it."""
        missing = []
        probe = path
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        for made in reversed(missing):
            made.mkdir()
            os.setxattr(made, CREATED_XATTR, b"1")
        if missing:
            self.state.created_paths = [str(m) for m in missing] + self.state.created_paths
            self._save()
