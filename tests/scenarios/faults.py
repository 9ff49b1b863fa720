"""What the fault and soak scenarios share: runners as CLI subprocesses, what a run left
on the engine (containers, networks, processes) and on the host (the lock), by run id."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from docker import DockerClient

from sandbox.contracts.names import (
    LABEL_ROLE,
    LABEL_RUN_ID,
    LABEL_RUNNER_PID,
)
from sandbox.prepare.lock import INFO_DIR_NAME, holders, lock_home, workflow_run_lock
from tests import paths
from tests.polling import wait_for

REPO = paths.REPO
DOCKERD_LOG = "/var/log/sandbox-dockerd.log"
HEX64 = re.compile(r"\b[0-9a-f]{64}\b")
GATED_STEP = (
    # Hold until the test writes `go` into the group folder (bounded: 240 s, as long as the
    # test waits for the last of 10 steps to start on a loaded machine), then pass.
    "i=0; while [ ! -e go ] && [ $i -lt 4800 ]; do sleep 0.05; i=$((i+1)); done; test -e go"
)


# -- helpers ---------------------------------------------------------------------------------


@dataclass
class Runner:
    """A `sandbox run --json` in its own process; its output goes to files (no pipe stalls)."""

    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finish(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise AssertionError(
                f"the runner (pid {self.pid}) hung for {timeout_s:g} s; stderr: {self.stderr()}"
            ) from None

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()[-2000:]

    def record(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.stdout())
        return data


def start_runner(wf: Path, logs: Path, tag: str = "runner") -> Runner:
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / f"{tag}.out", logs / f"{tag}.err"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox.cli", "run", str(wf), "step1", "--json"],
            stdout=o,
            stderr=e,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
        )
    return Runner(proc, out, err)


def sandbox_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def run_dirs(wf: Path) -> list[Path]:
    runs = wf / "runs"
    return sorted(runs.glob("test-*")) if runs.is_dir() else []


@dataclass(frozen=True)
class Listed:
    """One container as the engine lists it (no per-container inspect, so a container
    someone else removes meanwhile cannot make the listing fail)."""

    id: str
    name: str
    labels: dict[str, str]


def listing(
    engine: DockerClient, *, stopped: bool = True, label: str | list[str] = ""
) -> list[Listed]:
    filters = {"label": label} if label else None
    return [
        Listed(str(d["Id"]), str((d.get("Names") or ["?"])[0]).lstrip("/"), d.get("Labels") or {})
        for d in engine.api.containers(all=stopped, filters=filters)
    ]


def run_cids(engine: DockerClient, run_id: str) -> set[str]:
    return {c.id for c in listing(engine, label=f"{LABEL_RUN_ID}={run_id}")}


def run_containers(engine: DockerClient, run_id: str) -> list[str]:
    return [c.name for c in listing(engine, label=f"{LABEL_RUN_ID}={run_id}")]


def run_networks(engine: DockerClient, run_id: str) -> list[str]:
    return [
        str(n.name) for n in engine.networks.list(filters={"label": f"{LABEL_RUN_ID}={run_id}"})
    ]


def running_step(engine: DockerClient, runner: Runner) -> Any:
    """The runner's step container once it runs, else None; the runner must still live."""
    code = runner.proc.poll()
    assert code is None, f"the runner exited early ({code}): {runner.stdout()} {runner.stderr()}"
    found = engine.containers.list(
        filters={"label": [f"{LABEL_RUNNER_PID}={runner.pid}", f"{LABEL_ROLE}=step"]},
        ignore_removed=True,
    )
    return found[0] if found else None


def container_of(proc: psutil.Process) -> str | None:
    """The container a host process belongs to (its shim's -id, or its cgroup path)."""
    try:
        cmdline = proc.cmdline()
        if cmdline and "containerd-shim" in os.path.basename(cmdline[0]) and "-id" in cmdline:
            return cmdline[cmdline.index("-id") + 1]
        with open(f"/proc/{proc.pid}/cgroup", encoding="ascii", errors="replace") as handle:
            match = HEX64.search(handle.read())
        return match.group(0) if match else None
    except (psutil.Error, OSError, IndexError):
        return None


def processes_of(container_ids: set[str]) -> list[str]:
    """Host processes (container members and their shims) of these containers."""
    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        if container_of(proc) in container_ids:
            found.append(f"{proc.info['pid']} {proc.info['name']}")
    return found


def assert_lock_free(wf: Path) -> None:
    """Nobody holds the lock; a dead runner's sidecar is stale and the next holder drops it."""
    assert holders(wf) == [], f"the lock of {wf} is still held: {holders(wf)}"
    info_dir = lock_home(wf) / INFO_DIR_NAME

    def sidecars() -> list[str]:
        return sorted(p.name for p in info_dir.iterdir()) if info_dir.is_dir() else []

    live = [n for n in sidecars() if psutil.pid_exists(int(n.split("-")[0]))]
    assert live == [], f"lock sidecars of live processes: {live}"
    with workflow_run_lock(wf, exclusive=True, owner="faults test: is the lock free?"):
        pass
    assert sidecars() == [], f"lock sidecars left: {sidecars()}"


def assert_nothing_of_the_run_left(engine: DockerClient, run_id: str, cids: set[str]) -> None:
    assert run_containers(engine, run_id) == []
    assert run_networks(engine, run_id) == []
    # A shim may take a moment to go after its container is removed.
    wait_for(lambda: not processes_of(cids), 30, f"the processes of {run_id} to end")


def foreign_running(engine: DockerClient) -> list[str]:
    """Running containers on this engine that are not a sandbox run of this session."""
    mine = str(os.getpid())
    return [
        c.name for c in listing(engine, stopped=False) if c.labels.get(LABEL_RUNNER_PID) != mine
    ]
