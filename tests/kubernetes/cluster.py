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

For humans: `python -m tests.kubernetes.cluster up|down|status`.

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

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import secrets
import selectors
import shutil
import signal
import ssl
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import psutil
from pydantic import BaseModel

from sandbox.resources import seccomp_dir
from tests.kubernetes import pki
from tests.ports import free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "scripts" / "kubernetes-build.sh"
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


BUILD_STOP_GRACE_S = 5.0


def ensure_binaries(timeout_s: float | None = None) -> Path:
    """The cached build folder (`build/kubernetes/<version>/`), building it if missing.

    The build (minutes, many processes: apt-get, go) runs in its own process group and
    is waited for. Cut short (`timeout_s`, Ctrl-C, a test session's timeout), the whole
    group is stopped: nothing of a half-done build keeps running after the session,
    and the user is told to run the build on its own."""
    proc = subprocess.Popen(
        ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except BaseException as exc:
        _stop_group(proc)
        cause = "timed out" if isinstance(exc, subprocess.TimeoutExpired) else "was interrupted"
        raise ClusterError(
            f"building the cluster's binaries {cause} and was stopped; run "
            f"scripts/{BUILD_SCRIPT.name} on its own once (minutes; cached in build/kubernetes/)"
        ) from None
    if proc.returncode != 0:
        raise ClusterError(f"{BUILD_SCRIPT.name} failed (exit {proc.returncode})")
    return Path(out.strip().splitlines()[-1])


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the build's process group, SIGKILL to what is left after the grace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=BUILD_STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its children, should the leader have gone
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


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
            tail = f"\n{_tail(log)}" if log is not None else ""
            raise ClusterError(f"{what} not ready after {deadline_s:.0f} s{tail}")
        time.sleep(0.1)


def _tail(log: Path, lines: int = 25) -> str:
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _answers_ok(http: httpx.Client, url: str) -> bool:
    return http.get(url).text == "ok"


def _node_ready(node: Any) -> bool:
    conditions = node.status.conditions if node.status else None
    return any(c.type == "Ready" and c.status == "True" for c in conditions or [])


def _kubeconfig(server: str, ca: Path, token: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}
            ],
            "users": [{"name": "user", "user": {"token": token}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "user"}}],
            "current-context": "local",
        },
        indent=1,
    )


def pause_image_archive(pause_binary: Path, reference: str) -> bytes:
    """A one-layer `docker save`-format archive of the static pause binary (no builder needed)."""
    import hashlib

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pause")
        data = pause_binary.read_bytes()
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps(
        [{"Config": config_name, "RepoTags": [reference], "Layers": ["layer/layer.tar"]}]
    ).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, blob in (
            ("layer/layer.tar", layer_bytes),
            (config_name, config),
            ("manifest.json", manifest),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(blob), 0
            tar.addfile(info, io.BytesIO(blob))
    return out.getvalue()


def _ns_id(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def _cgroup_hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, the named systemd one, unified)."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype in ("cgroup", "cgroup2"):
                found.append(Path(fields[4]))
    return sorted(set(found))


def _procs_in_cgroup_tree(root: Path) -> set[int]:
    pids: set[int] = set()
    for dirpath, _dirs, _files in os.walk(root):
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in Path(dirpath, "cgroup.procs").read_text().split())
    return pids


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in this (the host's) mount namespace."""
    prefix = str(path)
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            if point == prefix or point.startswith(prefix + "/"):
                out.append(point)
    return out


def _holders_of(path: Path, limit: int = 10) -> list[str]:
    """Processes that keep `path` busy: a working directory, root or open file below it,
    or a mount namespace of their own with a mount below it (what `umount` calls busy)."""
    prefix = str(path)
    own_ns = _ns_id(os.getpid(), "mnt")

    def below(p: str) -> bool:
        return p == prefix or p.startswith(prefix + "/")

    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        why = []
        try:
            if below(proc.cwd()):
                why.append("cwd")
            if below(os.readlink(f"/proc/{proc.pid}/root")):
                why.append("root")
            if any(below(f.path) for f in proc.open_files()):
                why.append("open file")
            if _ns_id(proc.pid, "mnt") != own_ns:
                with open(f"/proc/{proc.pid}/mountinfo") as f:
                    if any(below(line.split()[4]) for line in f):
                        why.append("a mount in its namespace")
        except (psutil.Error, OSError):
            continue
        if why:
            found.append(f"{proc.pid} {proc.info['name']} ({', '.join(why)})")
        if len(found) >= limit:
            break
    return found


def _mounted_anywhere(path: str) -> bool:
    """Whether any live mount namespace on the host has a mount at `path`."""
    seen: set[str] = set()
    for pid in psutil.pids():
        try:
            ns = _ns_id(pid, "mnt")
            if ns in seen:
                continue
            seen.add(ns)
            with open(f"/proc/{pid}/mountinfo") as f:
                if any(line.split()[4] == path for line in f):
                    return True
        except OSError:
            continue
    return False


class Cluster:
    """One running cluster; see the module docstring for what it guarantees."""

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
        """`ctr` against a private containerd (the first node's by default), in the CRI's namespace."""
        cmd = [
            str(self.state.bin_dir / "ctr"),
            "--address",
            str(socket or self.state.containerd_socket),
            "--namespace",
            "k8s.io",
            *args,
        ]
        return subprocess.run(cmd, stdin=stdin, input=input, capture_output=True, check=check)

    def load_docker_images(self, *references: str) -> None:
        """Copy images from the host's Docker engine into every node (`docker save | ctr import`)."""
        if not self.state.extra_nodes:
            save = subprocess.Popen(["docker", "save", *references], stdout=subprocess.PIPE)
            try:
                result = self.ctr("images", "import", "-", stdin=save.stdout, check=False)
            finally:
                assert save.stdout is not None
                save.stdout.close()
                save.wait()
            if save.returncode != 0 or result.returncode != 0:
                raise ClusterError(
                    f"loading {references} failed: docker save exit {save.returncode}, "
                    f"ctr: {result.stderr.decode(errors='replace')[-500:]}"
                )
            return
        # Saved once, imported by each node's containerd.
        archive = self.state.directory / f"images-{secrets.token_hex(4)}.tar"
        try:
            subprocess.run(
                ["docker", "save", "-o", str(archive), *references], check=True, capture_output=True
            )
            sockets = [
                self.state.containerd_socket,
                *(n.containerd_socket for n in self.state.extra_nodes),
            ]
            for sock in sockets:
                result = self.ctr("images", "import", str(archive), check=False, socket=sock)
                if result.returncode != 0:
                    raise ClusterError(
                        f"loading {references} into {sock} failed: "
                        f"{result.stderr.decode(errors='replace')[-500:]}"
                    )
        except subprocess.CalledProcessError as exc:
            raise ClusterError(f"docker save {references} failed: {exc.stderr[-500:]!r}") from None
        finally:
            archive.unlink(missing_ok=True)

    def install_seccomp_profile(self, source: Path, name: str | None = None) -> str:
        """Install a profile on the node; returns the `localhostProfile` to name in a Pod."""
        name = name or source.name
        shutil.copyfile(source, self.state.seccomp_root / name)
        return name

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- start ----------------------------------------------------------------------

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
            owner=None if detached else _me(),
        )
        cluster = cls(state)
        cluster._save()
        try:
            cluster._start_all(bin_root, images, pod_pids_limit, log)
        except BaseException:
            cluster.stop(keep=True)
            raise
        log(
            f"cluster: {', '.join(cluster.node_names)} Ready in {time.monotonic() - t0:.1f} s ({directory})"
        )
        return cluster

    def _save(self) -> None:
        path = self.state.directory / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.state.model_dump_json(indent=1))
        tmp.replace(path)

    def _spawn(self, name: str, argv: list[str], *, in_namespace: bool = False) -> Daemon:
        log = self.state.directory / "logs" / f"{name}.log"
        log.parent.mkdir(exist_ok=True)
        if in_namespace:
            holder = next(x for x in self.state.daemons if x.name == "namespaces")
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
        return _process_alive(daemon.pid, daemon.started)

    def _wait_up(
        self, daemon: Daemon, what: str, check: Callable[[], bool], deadline_s: float
    ) -> None:
        """Wait for `check`, failing at once (with its log) if the daemon dies meanwhile."""

        def alive_and_ready() -> bool:
            if not self._alive(daemon):
                raise ClusterError(f"{daemon.name} exited during start-up:\n{_tail(daemon.log)}")
            return check()

        wait_for(what, alive_and_ready, deadline_s, daemon.log)

    def _start_all(
        self,
        bin_root: Path,
        images: tuple[str, ...],
        pod_pids_limit: int,
        log: Callable[[str], None],
    ) -> None:
        s, d, bin_dir = self.state, self.state.directory, self.state.bin_dir
        p = s.ports
        t0 = time.monotonic()
        pki_dir = d / "pki"
        pki_dir.mkdir(mode=0o700)
        ca = pki.CertificateAuthority(pki_dir, f"sandbox-test-cluster-{s.id}")
        etcd_crt, etcd_key = ca.issue("etcd", "etcd", server=True, client=True)
        etcd_client_crt, etcd_client_key = ca.issue("apiserver-etcd", "kube-apiserver", client=True)
        api_crt, api_key = ca.issue("apiserver", "kube-apiserver", server=True)
        kc_crt, kc_key = ca.issue("apiserver-kubelet", "kube-apiserver-kubelet-client", client=True)
        kubelet_crt, kubelet_key = ca.issue("kubelet", s.node_name, server=True)
        extra_certs = [
            ca.issue(f"kubelet-{n.name}", n.name, server=True, ip=n.name) for n in s.extra_nodes
        ]
        cm_crt, cm_key = ca.issue("controller-manager", "kube-controller-manager", server=True)
        sched_crt, sched_key = ca.issue("scheduler", "kube-scheduler", server=True)
        sa_key, sa_pub = pki.service_account_keys(pki_dir)
        tokens = {
            "admin": (s.admin_token, "admin", "system:masters"),
            "controller-manager": (secrets.token_urlsafe(24), "system:kube-controller-manager", ""),
            "scheduler": (secrets.token_urlsafe(24), "system:kube-scheduler", ""),
            "kubelet": (secrets.token_urlsafe(24), f"system:node:{s.node_name}", "system:nodes"),
            **{
                f"kubelet-{n.name}": (
                    secrets.token_urlsafe(24),
                    f"system:node:{n.name}",
                    "system:nodes",
                )
                for n in s.extra_nodes
            },
        }
        token_file = pki_dir / "tokens.csv"
        token_file.write_text(
            "".join(f'{tok},{user},{user},"{groups}"\n' for tok, user, groups in tokens.values())
        )
        token_file.chmod(0o600)
        server = f"https://127.0.0.1:{p.apiserver}"
        for name, (tok, _u, _g) in tokens.items():
            path = d / f"{name}.kubeconfig"
            path.write_text(_kubeconfig(server, ca.cert_path, tok))
            path.chmod(0o600)
        log(f"cluster: keys and certificates in {time.monotonic() - t0:.1f} s")

        etcd = self._spawn(
            "etcd",
            [
                str(bin_dir / "etcd"),
                f"--name=etcd-{s.id}",
                f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls=https://127.0.0.1:{p.etcd_client}",
                f"--advertise-client-urls=https://127.0.0.1:{p.etcd_client}",
                f"--listen-peer-urls=https://127.0.0.1:{p.etcd_peer}",
                f"--initial-advertise-peer-urls=https://127.0.0.1:{p.etcd_peer}",
                f"--initial-cluster=etcd-{s.id}=https://127.0.0.1:{p.etcd_peer}",
                f"--initial-cluster-token={s.id}",
                "--initial-cluster-state=new",
                f"--cert-file={etcd_crt}",
                f"--key-file={etcd_key}",
                f"--trusted-ca-file={ca.cert_path}",
                "--client-cert-auth",
                f"--peer-cert-file={etcd_crt}",
                f"--peer-key-file={etcd_key}",
                f"--peer-trusted-ca-file={ca.cert_path}",
                "--peer-client-cert-auth",
                "--logger=zap",
            ],
        )
        tls = ssl.create_default_context(cafile=str(ca.cert_path))
        tls.load_cert_chain(etcd_client_crt, etcd_client_key)
        tls_client = httpx.Client(verify=tls, timeout=2)
        self._wait_up(
            etcd,
            "etcd",
            lambda: (
                tls_client.get(f"https://127.0.0.1:{p.etcd_client}/health").json()["health"]
                == "true"
            ),
            30,
        )
        log(f"cluster: etcd up at {time.monotonic() - t0:.1f} s")

        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={p.apiserver}",
                f"--cert-dir={d / 'apiserver'}",
                f"--tls-cert-file={api_crt}",
                f"--tls-private-key-file={api_key}",
                f"--etcd-servers=https://127.0.0.1:{p.etcd_client}",
                f"--etcd-cafile={ca.cert_path}",
                f"--etcd-certfile={etcd_client_crt}",
                f"--etcd-keyfile={etcd_client_key}",
                f"--token-auth-file={token_file}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                # The fleet's runner Pod is privileged (its mounts and loop devices);
                # no run's Pod is (tests check the step and guard hold nothing).
                "--allow-privileged=true",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.0.0.0/24",
                # Loopback cannot be a Service endpoint; without a reconciler nothing tries.
                "--endpoint-reconciler-type=none",
                f"--kubelet-client-certificate={kc_crt}",
                f"--kubelet-client-key={kc_key}",
                f"--kubelet-certificate-authority={ca.cert_path}",
                "--kubelet-preferred-address-types=InternalIP",
                "--profiling=false",
            ],
        )
        trust_ca = ssl.create_default_context(cafile=str(ca.cert_path))
        api_http = httpx.Client(
            verify=trust_ca, headers={"Authorization": f"Bearer {s.admin_token}"}, timeout=2
        )
        self._wait_up(
            apiserver, "kube-apiserver", lambda: api_http.get(f"{server}/readyz").text == "ok", 90
        )
        log(f"cluster: kube-apiserver up at {time.monotonic() - t0:.1f} s")

        cm = self._spawn(
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                f"--kubeconfig={d / 'controller-manager.kubeconfig'}",
                f"--authentication-kubeconfig={d / 'controller-manager.kubeconfig'}",
                f"--authorization-kubeconfig={d / 'controller-manager.kubeconfig'}",
                "--bind-address=127.0.0.1",
                f"--secure-port={p.controller_manager}",
                "--port=0",
                f"--tls-cert-file={cm_crt}",
                f"--tls-private-key-file={cm_key}",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={ca.cert_path}",
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                "--profiling=false",
            ],
        )
        scheduler = self._spawn(
            "kube-scheduler",
            [
                str(bin_dir / "kube-scheduler"),
                f"--kubeconfig={d / 'scheduler.kubeconfig'}",
                f"--authentication-kubeconfig={d / 'scheduler.kubeconfig'}",
                f"--authorization-kubeconfig={d / 'scheduler.kubeconfig'}",
                "--bind-address=127.0.0.1",
                f"--secure-port={p.scheduler}",
                "--port=0",
                f"--tls-cert-file={sched_crt}",
                f"--tls-private-key-file={sched_key}",
                "--leader-elect=false",
                "--profiling=false",
            ],
        )

        self._make_cgroup_root()
        self._share_node_storage()
        self._start_namespaces()
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
        kubelet = self._start_kubelet(kubelet_crt, kubelet_key, ca.cert_path, pod_pids_limit)
        kubelets = [(s.node_name, kubelet)]
        for node, (crt, key) in zip(s.extra_nodes, extra_certs, strict=True):
            kubelets.append(
                (node.name, self._start_kubelet(crt, key, ca.cert_path, pod_pids_limit, node))
            )

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
        health = httpx.Client(verify=trust_ca, timeout=2)
        for daemon, port in ((cm, p.controller_manager), (scheduler, p.scheduler)):
            url = f"https://127.0.0.1:{port}/healthz"
            self._wait_up(daemon, daemon.name, partial(_answers_ok, health, url), 60)
        self._wait_default_service_account(60)
        loader.join()
        if load_error:
            raise load_error[0]
        log(f"cluster: images {images} loaded at {time.monotonic() - t0:.1f} s")

    def _make_cgroup_root(self) -> None:
        roots = [self.state.cgroup_root, *(n.cgroup_root for n in self.state.extra_nodes)]
        for hierarchy in _cgroup_hierarchies():
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
            lines.append(
                f"mount -t tmpfs -o size={self.state.image_store_size},mode=0700 sandbox-k8s {store}"
            )
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
        self.state.mount_ns = _ns_id(proc.pid, "mnt")
        self.state.net_ns = _ns_id(proc.pid, "net")
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
        if storage is None or not _mounts_under(storage):
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
            return done.returncode == 0 or not _mounts_under(storage)

        try:
            wait_for("the node storage's unmount", unmounted, UNMOUNT_DEADLINE_S)
        except ClusterError:
            holders = "; ".join(_holders_of(storage)) or "no process found holding it"
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

    def _start_containerd(self, bin_root: Path, node: ExtraNode | None = None) -> Daemon:
        """A node's containerd; every node's uses the same CNI config: one pod bridge and
        one IPAM store (host-local locks it), so Pods get distinct addresses on one link."""
        s, d = self.state, self.state.directory
        cni_bin = d / "cni" / "bin"
        cni_conf = d / "cni" / "conf"
        if node is None:
            self._write_cni(bin_root, cni_bin, cni_conf)
        cd = (d if node is None else node.folder) / "containerd"
        cd.mkdir(parents=True, exist_ok=True)
        socket = s.containerd_socket if node is None else node.containerd_socket
        runc = s.bin_dir / "runc"
        config = f"""
version = 2
root = "{cd / "root"}"
state = "{cd / "state"}"
disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp",
]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{cd / "runc"}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
"""
        (cd / "config.toml").write_text(config)
        env_path = f"{s.bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        return self._spawn(
            "containerd" if node is None else f"containerd-{node.name}",
            [
                "env",
                f"PATH={env_path}",
                str(s.bin_dir / "containerd"),
                "--config",
                str(cd / "config.toml"),
            ],
            in_namespace=True,
        )

    def _write_cni(self, bin_root: Path, cni_bin: Path, cni_conf: Path) -> None:
        s, d = self.state, self.state.directory
        cni_bin.mkdir(parents=True)
        cni_conf.mkdir()
        for plugin in ("host-local", "loopback"):
            (cni_bin / plugin).symlink_to(bin_root / "cni" / plugin)
        # The bridge plugin runs in the private network namespace: the bridge and the
        # host ends of the veths exist there and nowhere on the host.
        wrapper = cni_bin / "bridge"
        wrapper.write_text(
            "#!/bin/sh\n"
            f'exec nsenter --net={d / "switch-netns"} -- {bin_root / "cni" / "bridge"} "$@"\n'
        )
        wrapper.chmod(0o755)
        (cni_conf / "10-sandbox.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": f"sandbox-k8s-{s.id}",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": s.bridge,
                            "isGateway": False,
                            "ipMasq": False,
                            "hairpinMode": False,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": s.pod_subnet}]],
                                "dataDir": str(d / "cni" / "ipam"),
                            },
                        }
                    ],
                },
                indent=1,
            )
        )

    def _start_kubelet(
        self, crt: Path, key: Path, ca: Path, pod_pids_limit: int, node: ExtraNode | None = None
    ) -> Daemon:
        s, d = self.state, self.state.directory
        kd = d / "kubelet" if node is None else node.folder / "kubelet"
        kd.mkdir(parents=True)
        resolv = d / "resolv.conf"
        resolv.write_text("")  # pods get no nameserver: nothing outside to resolve with
        name = s.node_name if node is None else node.name
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": name,
            "port": s.ports.kubelet if node is None else node.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": name,
            "healthzPort": s.ports.kubelet_healthz if node is None else node.healthz_port,
            "tlsCertFile": str(crt),
            "tlsPrivateKeyFile": str(key),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(ca)},
            },
            # Only holders of a certificate from the cluster's CA (the apiserver) get in.
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": s.cgroup_root if node is None else node.cgroup_root,
            "cgroupsPerQOS": True,
            "makeIPTablesUtilChains": False,
            "failSwapOn": False,
            "resolvConf": str(resolv),
            "podPidsLimit": pod_pids_limit,
            "hairpinMode": "none",
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "50Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
            },
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
        }
        (kd / "config.json").write_text(json.dumps(config, indent=1))
        kubeconfig = d / ("kubelet.kubeconfig" if node is None else f"kubelet-{name}.kubeconfig")
        socket = s.containerd_socket if node is None else node.containerd_socket
        return self._spawn(
            "kubelet" if node is None else f"kubelet-{name}",
            [
                str(s.bin_dir / "kubelet"),
                f"--config={kd / 'config.json'}",
                f"--kubeconfig={kubeconfig}",
                "--container-runtime=remote",
                f"--container-runtime-endpoint=unix://{socket}",
                f"--root-dir={kd / 'root'}",
                f"--cert-dir={kd / 'pki'}",
                f"--seccomp-profile-root={s.seccomp_root}",
                f"--volume-plugin-dir={kd / 'volume-plugins'}",
                f"--hostname-override={name}",
                f"--pod-infra-container-image={PAUSE_IMAGE}",
            ],
            in_namespace=True,
        )

    def _wait_node_ready(self, kubelet: Daemon, deadline_s: float, name: str) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        with self.api_client() as api:
            core = client.CoreV1Api(api)

            def ready() -> bool:
                try:
                    return _node_ready(core.read_node(name))
                except ApiException as exc:
                    if exc.status == 404:  # not registered yet
                        return False
                    raise

            self._wait_up(kubelet, f"the node {name}", ready, deadline_s)

    def _wait_default_service_account(self, deadline_s: float) -> None:
        from kubernetes import client

        cm = next(x for x in self.state.daemons if x.name == "kube-controller-manager")
        with self.api_client() as api:
            core = client.CoreV1Api(api)
            self._wait_up(
                cm,
                "the default service account",
                lambda: core.read_namespaced_service_account("default", "default") is not None,
                deadline_s,
            )

    # ---- stop -----------------------------------------------------------------------

    @classmethod
    def attach(cls, directory: Path) -> Cluster:
        """The cluster whose `state.json` is in `directory` (running, half-started or dead)."""
        return cls(ClusterState.model_validate_json((directory / "state.json").read_text()))

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
        if "namespaces" in by_name:
            self._terminate([by_name["namespaces"]], 5)
        problems = self._unshare_node_storage()
        problems += self._remove_cgroup_root()
        problems += self._remove_created_paths()
        mounts = _mounts_under(s.directory)
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
            for h in _cgroup_hierarchies()
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
            pids |= _procs_in_cgroup_tree(root)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for freezer in frozen:
            with contextlib.suppress(OSError):
                (freezer / "freezer.state").write_text("THAWED")
        wait_for(
            "the cluster's containers to exit",
            lambda: not any(_procs_in_cgroup_tree(r) for r in self._cgroup_roots()),
            15,
        )

    def _namespace_members(self) -> list[int]:
        ours = {x for x in (self.state.mount_ns, self.state.net_ns) if x}
        holder = next((x for x in self.state.daemons if x.name == "namespaces"), None)
        members = []
        for pid in psutil.pids():
            if holder is not None and pid == holder.pid:
                continue
            try:
                if _ns_id(pid, "mnt") in ours or _ns_id(pid, "net") in ours:
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
            if not marked or _mounted_anywhere(path):
                continue
            try:
                p.rmdir()
            except OSError as e:
                problems.append(f"{path}: {e}")
        return problems

    # ---- status ---------------------------------------------------------------------

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
                    _node_ready(core.read_node(n, _request_timeout=3)) for n in self.node_names
                )
        except Exception as e:
            out["ready"] = f"unknown ({type(e).__name__})"
        return out


def _me() -> Daemon:
    return Daemon(name="owner", pid=os.getpid(), started=psutil.Process().create_time(), log=Path())


def _process_alive(pid: int, started: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
        if owner is not None and not _process_alive(owner.pid, owner.started):
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.kubernetes.cluster", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a cluster and leave it running")
    up.add_argument("--nodes", type=int, default=2, choices=(1, 2), help="how many nodes")
    up.add_argument(
        "--image", action="append", default=[], help="a Docker image to load (repeatable)"
    )
    down = sub.add_parser("down", help="stop clusters (all of this checkout's, or one)")
    down.add_argument("directory", nargs="?", type=Path)
    down.add_argument("--keep", action="store_true", help="keep the cluster's folder (logs)")
    sub.add_parser("status", help="list this checkout's clusters")
    args = parser.parse_args(argv)
    if args.command == "up":
        cluster = Cluster.start(images=tuple(args.image), nodes=args.nodes, detached=True)
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        return 0
    if args.command == "down":
        failed = 0
        for directory in [args.directory] if args.directory else running_clusters():
            try:
                Cluster.attach(directory).stop(keep=args.keep)
                print(f"stopped {directory}")
            except ClusterError as e:
                print(e, file=sys.stderr)
                failed = 1
        return failed
    for directory in running_clusters():
        print(json.dumps(Cluster.attach(directory).status(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
