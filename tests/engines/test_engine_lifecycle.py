"""A second engine comes and goes without a trace on the host, even when its session dies.

These run in the default suite: they use the tiny probe image (a few host programs,
imported in well under a second), so each engine costs about its start and stop
(a few seconds in all). They start engines of their own, never the session pool's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from testbed.engines import hoststate
from testbed.engines.engine_config import EngineConfig, check_main_engine
from testbed.engines.hoststate import Proc
from testbed.engines.second_engine import REPO_ROOT, SecondEngine, sweep

pytestmark = pytest.mark.engine

# Host settings a dockerd may write when it starts (none of them may change).
SYSCTLS = (
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
    "net/ipv6/conf/all/forwarding",
    "net/bridge/bridge-nf-call-iptables",
)
HOST_FILES = ("/etc/subuid", "/etc/subgid", "/etc/passwd", "/etc/group", "/etc/docker/key.json")


def _host_snapshot() -> dict[str, Any]:
    def digest(path: str) -> str | None:
        p = Path(path)
        return hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None

    return {
        "files": {f: digest(f) for f in HOST_FILES},
        "sysctls": {
            s: Path("/proc/sys", s).read_text() for s in SYSCTLS if Path("/proc/sys", s).exists()
        },
        "docker0": Path("/sys/class/net/docker0").exists(),
        "run_containerd": Path("/run/containerd").exists(),
    }


def _assert_gone(directory: Path, cgroup_parent: str, dockerd: Proc) -> None:
    assert not dockerd.alive()
    assert not directory.exists()
    assert not hoststate.mounts_under(directory)
    assert not hoststate.cgroup_dirs(cgroup_parent)
    mentions = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if str(directory) in " ".join(proc.info["cmdline"] or ()):
                mentions.append(proc.pid)
    assert not mentions, f"processes of the engine left: {mentions}"


def _status_ids(pid: int, field: str) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return [int(x) for x in line.split()[1:]]
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _output_of(
    engine: SecondEngine, image: str, argv: list[str], **kwargs: Any
) -> tuple[int, bytes]:
    """Run a container to its end; its exit code and output, read before it is removed.

    Not `containers.run(..., remove=True)`: docker-py then opens a follow stream, removes
    the container and only then reads that stream, which the engine may have ended empty
    (about one run in three here)."""
    container = engine.client.containers.run(image, argv, detach=True, **kwargs)
    try:
        code = container.wait(timeout=120)["StatusCode"]
        return code, container.logs(stdout=True, stderr=True)
    finally:
        container.remove(force=True)


@pytest.fixture
def foreign_mount(tmp_path: Path) -> Iterator[Path]:
    """A mount someone else made on the host before the engine started (a run's disk)."""
    point = tmp_path / "foreign"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "foreign", str(point)], check=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=False)


def test_a_stopped_engine_leaves_the_host_as_it_was() -> None:
    before = _host_snapshot()
    engine = SecondEngine.start(EngineConfig.userns())
    directory, cgroup_parent = engine.directory, engine.state.cgroup_parent
    assert engine.state.dockerd is not None
    dockerd = engine.state.dockerd
    try:
        probe = engine.load_probe_image()
        network = engine.client.networks.create(f"t-{secrets.token_hex(4)}", driver="bridge")
        container = engine.client.containers.run(
            probe, ["/usr/bin/sleep", "600"], user="10001:10001", network=network.name, detach=True
        )
        container.reload()
        pid = container.attrs["State"]["Pid"]
        assert engine.remap is not None
        assert _status_ids(pid, "Uid") == [engine.remap.outside + 10001] * 4
        assert pid in hoststate.procs_in_cgroups(cgroup_parent)
        # The engine's bridge is in the daemon's network namespace, not beside docker0.
        bridge = f"br-{str(network.id)[:12]}"
        assert bridge not in os.listdir("/sys/class/net")
        with engine.netns():
            assert bridge in [name for _index, name in socket.if_nameindex()]
        assert bridge not in [name for _index, name in socket.if_nameindex()]
        # While it runs, the host's files are untouched too (the remap reads its own).
        assert _host_snapshot() == before
    finally:
        engine.stop()  # checks the host's engine on its default network too
    _assert_gone(directory, cgroup_parent, dockerd)
    assert _host_snapshot() == before
    check_main_engine()


def test_host_mounts_reach_the_daemon_only_in_shared_folders(
    tmp_path: Path, foreign_mount: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    with SecondEngine.start(EngineConfig.plain(), share=(shared,)) as engine:
        daemon_points = {m.point for m in hoststate.mounts(engine.pid)}
        assert str(foreign_mount) not in daemon_points, "the daemon holds a copy of a host mount"
        assert not any("/docker/netns/" in p for p in daemon_points)
        probe = engine.load_probe_image()
        for folder in (shared, engine.workdir):
            disk = folder / f"disk-{secrets.token_hex(3)}"
            disk.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "d", str(disk)], check=True)
            try:
                (disk / "f").write_text("on the run's disk")
                code, out = _output_of(
                    engine,
                    probe,
                    ["/usr/bin/cat", "/d/f"],
                    volumes={str(disk): {"bind": "/d", "mode": "ro"}},
                    network_mode="none",
                )
                assert (code, out) == (0, b"on the run's disk")
            finally:
                subprocess.run(["umount", str(disk)], check=True)
            assert str(disk) not in {m.point for m in hoststate.mounts(engine.pid)}
        assert hoststate.top_mount(shared) is not None
    assert hoststate.top_mount(shared) is None, "the shared self-bind outlived the engine"
    assert hoststate.top_mount(foreign_mount) is not None


CHILD = """
import json, sys
from testbed.engines.engine_config import EngineConfig
from testbed.engines.second_engine import SecondEngine
engine = SecondEngine.start(EngineConfig.userns())
container = engine.client.containers.run(
    engine.load_probe_image(), ["/usr/bin/sleep", "600"], network_mode="none", detach=True,
)
container.reload()
print(json.dumps({"dir": str(engine.directory), "pid": container.attrs["State"]["Pid"]}), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("dockerd_killed_too", [False, True], ids=["session", "session+dockerd"])
def test_a_killed_session_is_swept(dockerd_killed_too: bool) -> None:
    """The session dies by SIGKILL (and, in the hard case, its dockerd too, so the
    containers and shims are orphans); the next session's sweep removes all of it."""
    before = _host_snapshot()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(child.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=120), "the child's engine did not start"
        line = child.stdout.readline()
        assert line, f"the child exited before its engine ran a container (rc {child.poll()})"
        started = json.loads(line)
        container = Proc.of(started["pid"])
    finally:
        if dockerd_killed_too and "started" in locals():
            state = SecondEngine.attach(Path(started["dir"])).state
            assert state.dockerd is not None and state.dockerd.alive()
            os.kill(state.dockerd.pid, signal.SIGKILL)
        child.kill()
        child.wait(timeout=30)
    directory = Path(started["dir"])
    state = SecondEngine.attach(directory).state
    assert state.dockerd is not None
    if dockerd_killed_too:
        assert container.alive(), "the orphaned container should still run"
    else:  # the parent-death signal stops dockerd, and dockerd its containers
        hoststate.wait_for("dockerd to stop itself", lambda: not state.dockerd.alive(), 60)  # type: ignore[union-attr]
    assert directory in sweep()
    assert not container.alive()
    _assert_gone(directory, state.cgroup_parent, state.dockerd)
    assert _host_snapshot() == before
