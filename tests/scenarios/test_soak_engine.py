"""The soak: sequential runs against the real engine leave nothing behind.

A short soak by default; the issue's 100 runs with `-m soak`. After them: no container,
network, process, mount, loop device, open descriptor or temp file left over.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import psutil
import pytest
from docker import DockerClient

from sandbox.backends.docker.gc import orphaned
from sandbox.contracts.names import (
    LABEL_MANAGED,
    LABEL_RUN_ROOT,
    LABEL_RUNNER_PID,
)
from sandbox.contracts.record import RunStatus
from sandbox.run.testrun import TestRun
from tests.conftest import WorkflowFactory, tree_digest
from tests.polling import wait_for
from tests.scenarios.faults import (
    assert_lock_free,
    container_of,
    listing,
    run_dirs,
)

pytestmark = pytest.mark.engine

SOAK_DEFAULT_RUNS = 30
SOAK_FULL_RUNS = 100


SOAK_STEP = """
import pathlib, sqlite3, os, agentworks_bridge
pathlib.Path("out.txt").write_text("soak")
con = sqlite3.connect(os.environ["DB_PATH"])
con.execute("INSERT INTO t (v) VALUES ('soak')")
con.commit()
assert agentworks_bridge.call("notify_user", {"text": "soak"})["decision"] == "stub"
"""


PROCESS_MARKS = ("docker-init", "containerd-shim", "agentworks_exec", "sandbox.guard")


@dataclass(frozen=True)
class HostState:
    """What a run could leave on the host, each part comparable before/after."""

    processes: frozenset[tuple[int, str, str]]  # (pid, name, container id or "")
    mounts: frozenset[str]
    tmp_entries: frozenset[str]
    containers: frozenset[str]  # sandbox-managed, of this process's runs or orphaned
    networks: frozenset[str]  # the same, for networks
    threads: int
    fds: frozenset[str]  # what this process's open descriptors point at


def open_fds() -> frozenset[str]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.add(f"{name} {os.readlink(f'/proc/self/fd/{name}')}")
    return frozenset(found)


def ours_or_orphaned(labels: dict[str, str]) -> bool:
    return labels.get(LABEL_RUNNER_PID) == str(os.getpid()) or orphaned(labels)


# The host engine's containerd: its shims name this namespace and one of these sockets
# (dockerd's own containerd, or the system's when dockerd uses that one).
HOST_SHIM_NAMESPACE = "moby"
HOST_CONTAINERD_SOCKETS = frozenset(
    {
        "/var/run/docker/containerd/containerd.sock",
        "/run/docker/containerd/containerd.sock",
        "/run/containerd/containerd.sock",
        "/var/run/containerd/containerd.sock",
    }
)


def other_containerd(cmdline: list[str]) -> bool:
    """A shim of another containerd on the machine (a private engine's, a local
    Kubernetes cluster's): its containers are someone else's, never a run's."""

    def flag(name: str) -> str | None:
        return cmdline[cmdline.index(name) + 1] if name in cmdline[:-1] else None

    namespace, address = flag("-namespace"), flag("-address")
    return (namespace is not None and namespace != HOST_SHIM_NAMESPACE) or (
        address is not None and address not in HOST_CONTAINERD_SOCKETS
    )


def host_state(engine: DockerClient) -> HostState:
    procs = set()
    elsewhere: set[str] = set()  # container ids of other containerds' shims
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status", "ppid"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE and proc.info["ppid"] == 1:
            continue  # a shim's short-lived middle process, init's to reap
        text = " ".join([proc.info["name"] or "", *(proc.info["cmdline"] or [])])
        cid = container_of(proc)
        if (
            cid is not None
            and "containerd-shim" in text
            and other_containerd(list(proc.info["cmdline"] or []))
        ):
            elsewhere.add(cid)
        if cid is not None or any(mark in text for mark in PROCESS_MARKS):
            procs.add((int(proc.info["pid"]), str(proc.info["name"]), cid or ""))
    procs = {p for p in procs if p[2] not in elsewhere}
    with open("/proc/mounts", encoding="utf-8", errors="replace") as handle:
        mounts = frozenset(line.split()[1] for line in handle if line.strip())
    tmp = frozenset(p.name for p in Path("/tmp").iterdir() if p.name.startswith("sandbox-"))
    networks = engine.api.networks(filters={"label": LABEL_MANAGED})
    me = psutil.Process()
    return HostState(
        processes=frozenset(procs),
        mounts=mounts,
        tmp_entries=tmp,
        containers=frozenset(
            c.name for c in listing(engine, label=LABEL_MANAGED) if ours_or_orphaned(c.labels)
        ),
        networks=frozenset(
            str(n["Name"]) for n in networks if ours_or_orphaned(n.get("Labels") or {})
        ),
        threads=me.num_threads(),
        fds=open_fds(),
    )


def loop_devices_of(root: Path) -> list[str]:
    """Loop devices backed by a file below ``root``."""
    found = []
    for entry in Path("/sys/block").glob("loop*"):
        with contextlib.suppress(OSError):
            backing = (entry / "loop" / "backing_file").read_text().strip()
            if backing.startswith(str(root) + "/"):
                found.append(f"/dev/{entry.name} -> {backing}")
    return found


def leftovers(base: HostState, workflow: Path | None = None) -> dict[str, Any]:
    """What is on the host now that was not at `base` and is not someone else's live work.

    Other sessions may run containers on a shared engine meanwhile: a process or mount of
    a container that exists now and is not of this process's runs is theirs, not a leak.
    (A client of its own, closed after: docker-py keeps the connection of every 404 reply
    open in its pool, and a container may vanish between listing and inspecting it.)"""
    with contextlib.closing(docker.from_env(timeout=60)) as engine:
        now = host_state(engine)
        prefix = f"{workflow}/" if workflow is not None else ""
        now_of_workflow = {
            c.name
            for c in listing(engine, label=LABEL_MANAGED)
            if c.labels.get(LABEL_RUN_ROOT, "").startswith(prefix)
        }
        foreign: set[str] = set()
        foreign_mounts: set[str] = set()
        for container in listing(engine):
            if container.labels.get(LABEL_RUNNER_PID) == str(os.getpid()):
                continue
            foreign.add(container.id)
            foreign_mounts.add(f"/var/lib/docker/containers/{container.id}/mounts/shm")
            try:
                attrs = engine.api.inspect_container(container.id)
            except docker.errors.NotFound:
                continue
            merged = ((attrs.get("GraphDriver") or {}).get("Data") or {}).get("MergedDir")
            key = (attrs.get("NetworkSettings") or {}).get("SandboxKey")
            foreign_mounts.update(str(p) for p in (merged, key) if p)
    found: dict[str, Any] = {
        "processes": sorted(p for p in now.processes - base.processes if p[2] not in foreign),
        # The runner's own mounts (each run's disk and view) are below the workflow; the
        # engine's follow its containers (checked below). On a shared engine, the engine
        # mounts of other users' containers come and go meanwhile.
        "mounts": sorted(
            m
            for m in now.mounts - base.mounts - foreign_mounts
            if workflow is None or m.startswith(str(workflow) + "/")
        ),
        "loop devices": loop_devices_of(workflow) if workflow is not None else [],
        # Other suites on the same machine make their own fakes' temp folders and leave
        # their own orphans meanwhile: a run of this workflow is named by its run root.
        "tmp entries": sorted(
            t for t in now.tmp_entries - base.tmp_entries if not t.startswith("sandbox-fake-")
        ),
        "containers": sorted(
            c for c in now.containers - base.containers if workflow is None or c in now_of_workflow
        ),
        "networks": sorted(now.networks - base.networks),
    }
    if now.threads > base.threads + 1:
        found["runner threads"] = sorted(t.name for t in threading.enumerate())
    if len(now.fds) > len(base.fds) + 2:
        found["runner fds"] = sorted(now.fds - base.fds)
    return {what: items for what, items in found.items() if items}


def soak(engine: DockerClient, make_workflow: WorkflowFactory, runs: int) -> None:
    wf = make_workflow(
        "soak",
        command=["python3", "/workflow/code/step.py"],
        earlier_files={"in.txt": "x"},
    )
    (wf / "code" / "step.py").write_text(SOAK_STEP)
    real = tree_digest(wf)
    # Warm up once (first-use imports, the engine's caches), then take the baseline.
    assert TestRun(wf, "step1").execute().status is RunStatus.PASSED
    with contextlib.closing(docker.from_env(timeout=60)) as client:
        base = host_state(client)
    started = time.monotonic()
    walls = []
    for i in range(runs):
        t0 = time.monotonic()
        record = TestRun(wf, "step1").execute()
        walls.append(time.monotonic() - t0)
        assert record.status is RunStatus.PASSED, f"run {i}: {record.reason} {record.stderr.text}"
        assert record.stubbed and record.db_diff is not None
    total = time.monotonic() - started
    print(
        f"\nsoak: {runs} runs in {total:.1f} s (mean {total / runs:.2f} s, max {max(walls):.2f} s)"
    )
    # A shim may take a moment to go, and other work on a shared engine comes and goes:
    # poll for one clean look, then assert on the last look (a failure names what was left).
    last: list[dict[str, Any]] = []

    def clean() -> bool:
        last.append(leftovers(base, wf))
        return not last[-1]

    with contextlib.suppress(AssertionError):
        wait_for(clean, 30, "the host to settle")
    assert last[-1] == {}
    assert tree_digest(wf) == real
    assert_lock_free(wf)
    dirs = run_dirs(wf)
    assert len(dirs) == runs + 1
    for d in dirs:
        hidden = [p.name for p in d.rglob(".*") if p.name != ".baseline"]
        assert hidden == [], f"temp files left in {d}: {hidden}"


def test_soak_leaves_nothing_behind(engine: DockerClient, make_workflow: WorkflowFactory) -> None:
    soak(engine, make_workflow, SOAK_DEFAULT_RUNS)


@pytest.mark.soak
def test_soak_100_runs_leaves_nothing_behind(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    soak(engine, make_workflow, SOAK_FULL_RUNS)
