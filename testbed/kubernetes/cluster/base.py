"""A cluster's handle: its state on disk, its daemons, and what tests use of it.

Every daemon is spawned in its own session with its log in `logs/`, and recorded in
`state.json` (pid and start time) before anything waits on it, so stop() finds it
whatever happens next.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from testbed.kubernetes.cluster.state import (
    ClusterError,
    ClusterState,
    Daemon,
    log_tail,
    process_alive,
    wait_for,
)


class ClusterBase:
    """The state, the daemons and what tests use; the parts that start and stop a
    cluster build on it (`lifecycle.Cluster`)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state

    # ---- what tests use -------------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self.state.directory

    @property
    def kubeconfig(self) -> Path:
        return self.state.kubeconfig

    @property
    def node_name(self) -> str:
        return self.state.node_name

    @property
    def node_names(self) -> list[str]:
        return [self.state.node_name, *(n.name for n in self.state.extra_nodes)]

    @property
    def node_storage(self) -> Path:
        """Where a test puts host folders a Pod mounts through a hostPath: mounts made
        under it on the host after start (a run's disk, its workflow view) reach the
        node. The host's own mounts are private, so elsewhere they would not."""
        assert self.state.node_storage is not None
        return self.state.node_storage

    @property
    def seccomp_root(self) -> Path:
        """The kubelet's seccomp root: a `Localhost` profile `x.json` is this folder's `x.json`."""
        return self.state.seccomp_root

    def api_client(self) -> Any:
        """A `kubernetes.client.ApiClient` with the cluster's admin token."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.state.kubeconfig))

    def ctr(
        self,
        *args: str,
        stdin: Any = None,
        input: bytes | None = None,
        check: bool = True,
        socket: Path | None = None,
    ) -> subprocess.CompletedProcess[bytes]:
        """`ctr` against a private containerd (the first node's by default), in the CRI's
        namespace."""
        cmd = [
            str(self.state.bin_dir / "ctr"),
            "--address",
            str(socket or self.state.containerd_socket),
            "--namespace",
            "k8s.io",
            *args,
        ]
        return subprocess.run(cmd, stdin=stdin, input=input, capture_output=True, check=check)

    def install_seccomp_profile(self, source: Path, name: str | None = None) -> str:
        """Install a profile on the node; returns the `localhostProfile` to name in a Pod."""
        name = name or source.name
        shutil.copyfile(source, self.state.seccomp_root / name)
        return name

    def _save(self) -> None:
        path = self.state.directory / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.state.model_dump_json(indent=1))
        tmp.replace(path)

    def _spawn(
        self, name: str, argv: list[str], *, in_namespace: bool = False, node: str = ""
    ) -> Daemon:
        """A daemon of the cluster; `in_namespace`: in the nodes' mount namespace, or, with
        `node` (a node beyond the first), in that node's own."""
        log = self.state.directory / "logs" / f"{name}.log"
        log.parent.mkdir(exist_ok=True)
        if in_namespace:
            holder_name = f"namespaces-{node}" if node else "namespaces"
            holder = next(x for x in self.state.daemons if x.name == holder_name)
            argv = ["nsenter", f"--mount=/proc/{holder.pid}/ns/mnt", "--", *argv]
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.state.directory,
            )
        daemon = Daemon(
            name=name, pid=proc.pid, started=psutil.Process(proc.pid).create_time(), log=log
        )
        self.state.daemons.append(daemon)
        self._save()
        return daemon

    def _alive(self, daemon: Daemon) -> bool:
        return process_alive(daemon.pid, daemon.started)

    def _wait_up(
        self, daemon: Daemon, what: str, check: Callable[[], bool], deadline_s: float
    ) -> None:
        """Wait for `check`, failing at once (with its log) if the daemon dies meanwhile."""

        def alive_and_ready() -> bool:
            if not self._alive(daemon):
                raise ClusterError(f"{daemon.name} exited during start-up:\n{log_tail(daemon.log)}")
            return check()

        wait_for(what, alive_and_ready, deadline_s, daemon.log)
