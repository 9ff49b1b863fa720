"""Faults against the real engine: what a test run leaves behind when something dies.

One test per fault (issue 6, item 4). After each: the run has a valid record that
says what happened, nothing of the run is left (no container, network, process or
mount), the workflow's lock is free, and the real workflow folder is byte-identical.

- the runner SIGKILLed mid-run: `sandbox gc` and the next run recover (this goes
  further than tests/scenarios/test_cli_engine.py's version: processes, networks, the lock);
- the guard killed: tests/scenarios/test_guard_engine.py::
  test_killing_the_guard_fails_closed_and_records_error (not repeated here);
- the step container killed from outside (`docker kill`);
- the workflow DB locked by a writer during the copy (dbcopy's guarantee: a
  consistent copy, or an `error` record once the copy timeout has passed);
- 20 runs started at once across 10 workflows: one runs per workflow, the other is
  refused with a record, none lost;
- a soak of sequential runs (a short one by default; the issue's 100 runs with
  `-m soak`): no container, network, process, mount or temp file left over;
- dockerd stopped and restarted mid-run (`engine_restart`, root only). It kills every
  container on the engine, so this module moves it to the very end of the session
  (see `pytest_collection_modifyitems` below), and skips it while containers other
  than this session's run on the engine (someone else's work on a shared host).

Runners are CLI subprocesses (`python -m sandbox.cli run`) where a fault must hit a
separate process or a hang must be killable; in-process where a parameter is patched.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import shlex
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import psutil
import pytest
from docker import DockerClient

import sandbox.prepare.rundir as rundir_module
from sandbox.backends.docker.gc import orphaned
from sandbox.contracts.layout import RunLayout
from sandbox.contracts.names import (
    LABEL_MANAGED,
    LABEL_ROLE,
    LABEL_RUN_ID,
    LABEL_RUN_ROOT,
    LABEL_RUNNER_PID,
)
from sandbox.contracts.record import RECORD_FILE, RunStatus, TestRunRecord, read_record
from sandbox.prepare.dbcopy import copy_db
from sandbox.prepare.lock import INFO_DIR_NAME, holders, lock_home, workflow_run_lock
from sandbox.run.testrun import TestRun
from tests import paths
from tests.conftest import WorkflowFactory, tree_digest
from tests.polling import wait_for

pytestmark = pytest.mark.engine

# This module's hook below (run the engine restart last; the long soak only with -m soak)
# is registered by naming the module as a plugin of itself: pytest hooks are not read
# from test modules otherwise, and conftest.py is shared with other work.
pytest_plugins = [__name__]


REPO = paths.REPO
DOCKERD_LOG = "/var/log/sandbox-dockerd.log"
HEX64 = re.compile(r"\b[0-9a-f]{64}\b")
SOAK_DEFAULT_RUNS = 30
SOAK_FULL_RUNS = 100
GATED_STEP = (
    # Hold until the test writes `go` into the group folder (bounded: 240 s, as long as the
    # test waits for the last of 10 steps to start on a loaded machine), then pass.
    "i=0; while [ ! -e go ] && [ $i -lt 4800 ]; do sleep 0.05; i=$((i+1)); done; test -e go"
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The soak and the engine restart run only on request (`-m soak`, `-m engine_restart`):
    restarting the engine stops every container on it, everyone's on a shared host."""
    markexpr = config.getoption("markexpr", "") or ""
    for item in items:
        if item.get_closest_marker("soak") is not None and "soak" not in markexpr:
            item.add_marker(pytest.mark.skip(reason="the 100-run soak runs with -m soak"))
        if item.get_closest_marker("engine_restart") is not None and (
            "engine_restart" not in markexpr
        ):
            item.add_marker(
                pytest.mark.skip(reason="restarts the host's dockerd; runs with -m engine_restart")
            )
    items.sort(key=lambda item: item.get_closest_marker("engine_restart") is not None)


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
        filters={"label": [f"{LABEL_RUNNER_PID}={runner.pid}", f"{LABEL_ROLE}=step"]}
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


# -- the runner killed -------------------------------------------------------------------------


# A stdio MCP server that says nothing and waits: its container holds the run's view.
IDLE_MCP_SERVER = """
[[mcp_servers]]
name = "idle"
command = ["python3", "-c", "import time; time.sleep(600)"]
"""


@pytest.mark.parametrize("with_mcp", [False, True], ids=["step-and-guard", "with-mcp-server"])
def test_runner_sigkilled_mid_run_gc_and_the_next_run_recover(
    engine: DockerClient, make_workflow: WorkflowFactory, tmp_path: Path, with_mcp: bool
) -> None:
    """gc removes every container of a dead runner's run (the MCP servers' too, which
    hold its view of the workflow folder), unmounts its disk and view, marks it killed."""
    wf = make_workflow(
        command="sleep 300",
        timeout_s=600,
        earlier_files={"in.txt": "x"},
        extra_toml=IDLE_MCP_SERVER if with_mcp else "",
    )
    before = tree_digest(wf)
    roles = ["guard", "step", *(["mcp-idle"] if with_mcp else [])]
    runner = start_runner(wf, tmp_path / "logs")
    try:
        step = wait_for(lambda: running_step(engine, runner), 120, "the step to start")
        run_id = step.labels[LABEL_RUN_ID]
        wait_for(lambda: len(run_cids(engine, run_id)) == len(roles), 120, "every container")
    finally:
        runner.proc.send_signal(signal.SIGKILL)
        runner.proc.wait(timeout=30)
    cids = run_cids(engine, run_id)
    assert len(cids) == len(roles), f"containers: {roles}"
    assert processes_of(cids), "the step's processes are visible before gc (the check works)"
    (run_dir,) = run_dirs(wf)
    assert read_record(run_dir).status is RunStatus.RUNNING

    gc = sandbox_cli("gc", str(wf), "--json")
    assert gc.returncode == 0, gc.stderr
    report = json.loads(gc.stdout)
    # gc also removes any other dead runner's leftovers on this engine; these are ours.
    removed_of_run = [name for name in report["containers_removed"] if run_id in name]
    assert sorted(removed_of_run) == sorted(f"sandbox-{run_id}-{role}" for role in roles)
    assert report["records_marked_killed"] == [str(run_dir)]
    # The run's disk (its loop device goes with it) and its view of the workflow folder.
    mounts = {Path(p).name for p in report["mounts_removed"] if p.startswith(str(run_dir) + "/")}
    assert mounts == {".disk", ".view", ".view-hidden", ".disk.img"}, report["mounts_removed"]
    record = read_record(run_dir)
    assert record.status is RunStatus.KILLED and "sandbox gc" in record.reason
    assert record.finished_at is not None
    assert_nothing_of_the_run_left(engine, run_id, cids)
    assert_lock_free(wf)
    assert tree_digest(wf) == before
    second = sandbox_cli("gc", str(wf), "--json")
    assert second.returncode == 0 and second.stdout, (second.returncode, second.stderr[-2000:])
    again = json.loads(second.stdout)
    assert again == {
        "containers_removed": [],
        "networks_removed": [],
        "mounts_removed": [],
        "records_marked_killed": [],
        "pods_removed": [],
        "secrets_removed": [],
        "runs_removed": [],
        "errors": [],
    }

    text = (wf / "workflow.toml").read_text().replace('"sleep 300"', '"true"')
    (wf / "workflow.toml").write_text(text)
    next_run = sandbox_cli("run", str(wf), "step1")
    assert next_run.returncode == 0, next_run.stdout + next_run.stderr


# -- the guard killed: tests/scenarios/test_guard_engine.py::test_killing_the_guard_fails_closed_and_
# records_error kills the guard between two bridge calls of a live step and asserts the
# second call fails closed and the record says `error` ("the guard stopped").


# -- the step killed ---------------------------------------------------------------------------


def test_step_container_killed_from_outside_is_a_failed_run(
    engine: DockerClient, make_workflow: WorkflowFactory, tmp_path: Path
) -> None:
    wf = make_workflow(command="sleep 300", timeout_s=600, earlier_files={"in.txt": "x"})
    before = tree_digest(wf)
    runner = start_runner(wf, tmp_path / "logs")
    try:
        step = wait_for(lambda: running_step(engine, runner), 120, "the step to start")
        run_id = step.labels[LABEL_RUN_ID]
        cids = run_cids(engine, run_id)
        started = time.monotonic()
        step.kill()  # SIGKILL to the container's pid 1, from outside: `docker kill`
        code = runner.finish(60)
        took = time.monotonic() - started
    finally:
        if runner.proc.poll() is None:
            runner.proc.kill()
            runner.proc.wait(timeout=30)
    assert code == 1, runner.stderr()
    record = runner.record()
    assert record["status"] == "failed"
    assert record["exit_code"] == 137
    assert record["reason"] == "step exited with code 137"
    assert took < 30, f"the runner took {took:.1f} s to notice"
    assert read_record(run_dirs(wf)[0]).status is RunStatus.FAILED
    assert_nothing_of_the_run_left(engine, run_id, cids)
    assert_lock_free(wf)
    assert tree_digest(wf) == before


# -- the DB locked by a writer during the copy ---------------------------------------------------

WRITER = r"""
import sqlite3, sys
db, begin, wal = sys.argv[1], sys.argv[2], sys.argv[3] == "wal"
con = sqlite3.connect(db, isolation_level=None, timeout=0)
if wal:
    con.execute("PRAGMA wal_autocheckpoint=0")  # keep the committed row in the -wal file
    con.execute("INSERT INTO t VALUES (3, 'committed, only in the WAL')")
con.execute(f"BEGIN {begin}")
con.execute("INSERT INTO t VALUES (2, 'pending')")
print("LOCKED", flush=True)
con.execute(sys.stdin.readline().strip())  # COMMIT or ROLLBACK
print("DONE", flush=True)
"""

COPY_TIMEOUT_S = 4.0


@dataclass
class Writer:
    proc: subprocess.Popen[str]

    def expect(self, word: str, timeout_s: float = 30) -> None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, f"the writer did not say {word} within {timeout_s:g} s"
        line = self.proc.stdout.readline().strip()
        assert line == word, f"the writer said {line!r}, not {word}"

    def end(self, statement: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(statement + "\n")
        self.proc.stdin.flush()
        self.expect("DONE")
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def writer_holding(db: Path, begin: str, wal: bool) -> Iterator[Writer]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db), begin, "wal" if wal else "rollback"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    writer = Writer(proc)
    try:
        writer.expect("LOCKED")
        yield writer
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def copy_rows(wf: Path, record: TestRunRecord) -> list[tuple[int, str]]:
    con = sqlite3.connect(f"file:{wf / 'runs' / record.id / 'db' / 'db.sqlite'}?mode=ro", uri=True)
    try:
        return [(int(r[0]), str(r[1])) for r in con.execute("SELECT id, v FROM t ORDER BY id")]
    finally:
        con.close()


def helper_running() -> bool:
    """dbcopy's snapshot helper (a child of this process) is trying to copy."""
    for child in psutil.Process().children(recursive=True):
        try:
            if "sandbox.prepare.dbsnapshot" in " ".join(child.cmdline()):
                return True
        except psutil.Error:  # a child that ended (or is a zombie) since it was listed
            continue
    return False


@pytest.mark.parametrize(
    ("case", "begin", "wal"),
    [
        ("reserved lock, pending write (rollback journal)", "IMMEDIATE", False),
        ("write lock, pending write, committed rows in the WAL", "IMMEDIATE", True),
        ("exclusive lock held past the copy timeout", "EXCLUSIVE", False),
        ("exclusive lock released while the copy waits", "EXCLUSIVE", False),
    ],
)
def test_db_locked_by_a_writer_during_the_copy(
    engine: DockerClient,
    make_workflow: WorkflowFactory,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    begin: str,
    wal: bool,
) -> None:
    """dbcopy guarantees a copy consistent at one instant (committed rows in, the pending
    write out) or, when a conflicting lock outlasts the copy timeout, an `error` record
    and nothing half-made. The timeout is lowered from 30 s to keep the test short."""
    monkeypatch.setattr(
        rundir_module, "copy_db", functools.partial(copy_db, timeout_s=COPY_TIMEOUT_S)
    )
    wf = make_workflow(command="true", earlier_files={"in.txt": "x"})
    db = wf / "db" / "db.sqlite"
    if wal:
        con = sqlite3.connect(db)
        con.execute("PRAGMA journal_mode=WAL")
        con.close()
    original = db.read_bytes()
    released = case.startswith("exclusive lock released")

    with writer_holding(db, begin, wal) as writer:
        before = tree_digest(wf)  # with the writer's -journal / -wal / -shm as they are now
        result: list[TestRunRecord] = []
        thread = threading.Thread(target=lambda: result.append(TestRun(wf, "step1").execute()))
        started = time.monotonic()
        thread.start()
        if released:
            wait_for(helper_running, 30, "the DB copy to start")
            writer.end("COMMIT")
        thread.join(timeout=120)
        took = time.monotonic() - started
        assert not thread.is_alive(), "the run hung"
        (record,) = result
        if not released:
            assert tree_digest(wf) == before, "the run changed the real DB or its side files"
            writer.end("ROLLBACK")
    assert not run_containers(engine, record.id)

    if case.startswith("exclusive lock held"):
        assert record.status is RunStatus.ERROR, record.reason
        assert record.reason.startswith("workflow DB cannot be copied:")
        assert "database is locked" in record.reason
        assert f"busy timeout of {COPY_TIMEOUT_S:g}s" in record.reason
        assert took < COPY_TIMEOUT_S + 15, f"the error took {took:.1f} s"
        run_dir = wf / "runs" / record.id
        assert sorted(p.name for p in run_dir.iterdir()) == [RECORD_FILE, "test_mode_actions.jsonl"]
        assert read_record(run_dir).status is RunStatus.ERROR
        assert db.read_bytes() == original
        return

    assert record.status is RunStatus.PASSED, record.reason
    assert record.db_copy is not None
    rows = copy_rows(wf, record)
    if released:
        assert rows == [(1, "one"), (2, "pending")], "the committed write is in the copy"
    elif wal:
        assert rows == [(1, "one"), (3, "committed, only in the WAL")]
    else:
        assert rows == [(1, "one")], "the pending write is not in the copy"
        assert db.read_bytes() == original


# -- 20 runs at once across 10 workflows ----------------------------------------------------------


def test_twenty_runs_at_once_one_per_workflow_runs_the_others_are_refused(
    engine: DockerClient, make_workflow: WorkflowFactory, tmp_path: Path
) -> None:
    workflows = [make_workflow(f"wf{i}", command=GATED_STEP, timeout_s=300) for i in range(10)]
    logs = tmp_path / "logs"
    runners: dict[Path, list[Runner]] = {wf: [] for wf in workflows}
    try:
        for n in range(2):
            for wf in workflows:
                runners[wf].append(start_runner(wf, logs, f"{wf.name}-{n}"))
        everyone = [r for pair in runners.values() for r in pair]

        def all_accounted() -> bool:
            refused = sum(1 for r in everyone if r.proc.poll() == 3)
            failed = [r.stderr() for r in everyone if r.proc.poll() not in (None, 3)]
            assert not failed, f"a runner ended early: {failed}"
            mine = {str(r.pid) for r in everyone}
            stepping = sum(
                1
                for c in listing(engine, stopped=False, label=f"{LABEL_ROLE}=step")
                if c.labels.get(LABEL_RUNNER_PID) in mine
            )
            return refused == 10 and stepping == 10

        wait_for(all_accounted, 240, "10 refusals and 10 running steps")
        for wf in workflows:
            (live,) = [d for d in run_dirs(wf) if read_record(d).status is RunStatus.RUNNING]
            (RunLayout(wf, live.name, "g").disk_group / "go").write_text("go")
        codes = {r.pid: r.finish(120) for r in everyone}
    finally:
        for pair in runners.values():
            for r in pair:
                if r.proc.poll() is None:
                    r.proc.kill()
                    r.proc.wait(timeout=30)

    records_on_disk = 0
    for wf, pair in runners.items():
        assert sorted(codes[r.pid] for r in pair) == [0, 3], [r.stderr() for r in pair]
        by_status = {r.record()["status"]: (r, r.record()) for r in pair}
        assert set(by_status) == {"passed", "refused"}
        winner, _ = by_status["passed"]
        _, refused = by_status["refused"]
        assert "is busy" in refused["reason"]
        assert f"lock held by pid {winner.pid} " in refused["reason"], refused["reason"]
        dirs = run_dirs(wf)
        assert sorted(d.name for d in dirs) == sorted(r.record()["id"] for r in pair)
        for d in dirs:
            read_record(d)  # valid against the model
            records_on_disk += 1
        assert_lock_free(wf)
    assert records_on_disk == 20, "every run left a record"
    pids = {str(r.pid) for pair in runners.values() for r in pair}
    left = [
        c.name
        for c in listing(engine, label=LABEL_MANAGED)
        if c.labels.get(LABEL_RUNNER_PID) in pids
    ]
    assert left == [], f"containers left: {left}"


# -- the soak --------------------------------------------------------------------------------------

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


# -- the engine restarted mid-run (last) -----------------------------------------------------------


def dockerd() -> psutil.Process | None:
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "dockerd":
            return proc
    return None


def engine_answers() -> bool:
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def ensure_engine(cmdline: list[str]) -> None:
    """Return only once the engine answers; start dockerd as scripts/ensure-engine.sh does
    (a stale pid file out, nohup, detached, appending to its log) if none runs."""
    daemon = dockerd()
    if daemon is not None:
        with contextlib.suppress(AssertionError):
            wait_for(engine_answers, 60, "the running dockerd to answer")
            return
        with contextlib.suppress(psutil.NoSuchProcess):  # alive, not answering: stuck
            daemon.kill()
            daemon.wait(timeout=30)
    with contextlib.suppress(FileNotFoundError):
        os.unlink("/var/run/docker.pid")
    # The command line of the engine that ran before (`dockerd` here).
    subprocess.run(
        ["/bin/sh", "-c", f"nohup {shlex.join(cmdline)} >>{DOCKERD_LOG} 2>&1 </dev/null &"],
        check=True,
        start_new_session=True,
        timeout=30,
    )
    wait_for(engine_answers, 120, "the engine to answer again")


@pytest.mark.engine_restart
def test_engine_restarted_mid_run_leaves_a_valid_record_and_gc_cleans_up(
    engine: DockerClient, make_workflow: WorkflowFactory, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("restarting the engine needs root")
    daemon = dockerd()
    if daemon is None:
        pytest.skip("no local dockerd process to restart (remote or rootless engine)")
    others = foreign_running(engine)
    if others:
        pytest.skip(f"other containers run on this engine; not stopping them: {others}")
    cmdline = daemon.cmdline()
    wf = make_workflow(command="sleep 300", timeout_s=600, earlier_files={"in.txt": "x"})
    before = tree_digest(wf)
    runner = start_runner(wf, tmp_path / "logs")
    restart_s = 0.0
    try:
        step = wait_for(lambda: running_step(engine, runner), 120, "the step to start")
        run_id = step.labels[LABEL_RUN_ID]
        cids = run_cids(engine, run_id)
        t0 = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=90)  # it stops its containers first (10 s grace each)
        ensure_engine(cmdline)
        restart_s = time.monotonic() - t0
        code = runner.finish(120)
    finally:
        if runner.proc.poll() is None:
            runner.proc.kill()
            runner.proc.wait(timeout=30)
        ensure_engine(cmdline)  # whatever happened above, the engine answers again
    print(f"\nengine restart took {restart_s:.1f} s; runner exit {code}")

    (run_dir,) = run_dirs(wf)
    record = read_record(run_dir)  # as the runner left it, before gc may rewrite it
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    gc = sandbox_cli("gc", str(wf))  # first, so a failure below leaves nothing behind
    assert gc.returncode == 0, gc.stderr

    assert record.status in (RunStatus.ERROR, RunStatus.KILLED), (
        f"the runner exited {code} and left the record {record.status.value!r}; "
        f"stderr: {runner.stderr()}"
    )
    assert record.reason and record.finished_at is not None
    assert code in (1, 2), runner.stderr()
    assert "Traceback" not in runner.stderr()
    # No half-made files: only what a run that got as far as its step has, no temp files.
    assert {f.split("/")[0] for f in files} <= {
        RECORD_FILE,
        "test_mode_actions.jsonl",
        "g",
        "db",
        ".baseline",
        "guard",
    }, files
    hidden = [f for f in files if any(p.startswith(".") and p != ".baseline" for p in f.split("/"))]
    assert hidden == [], "temp files left"
    assert read_record(run_dir).status is record.status, "gc does not rewrite a finished record"

    with contextlib.closing(docker.from_env(timeout=60)) as client:  # to the new engine
        assert_nothing_of_the_run_left(client, run_id, cids)
    assert_lock_free(wf)
    assert tree_digest(wf) == before
    text = (wf / "workflow.toml").read_text().replace('"sleep 300"', '"true"')
    (wf / "workflow.toml").write_text(text)
    next_run = sandbox_cli("run", str(wf), "step1")
    assert next_run.returncode == 0, next_run.stdout + next_run.stderr
