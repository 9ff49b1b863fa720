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
- dockerd stopped and restarted mid-run (`engine_restart`, root only). It kills every
  container on the engine, so this module moves it to the very end of the session
  (tests/conftest.py sorts it last), and skips it while containers other
  than this session's run on the engine (someone else's work on a shared host).

Runners are CLI subprocesses (`python -m sandbox.cli run`) where a fault must hit a
separate process or a hang must be killable; in-process where a parameter is patched.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
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

import docker
import docker.errors
import psutil
import pytest
from docker import DockerClient

import sandbox.prepare.rundir as rundir_module
from sandbox.contracts.layout import RunLayout
from sandbox.contracts.names import (
    LABEL_MANAGED,
    LABEL_ROLE,
    LABEL_RUN_ID,
    LABEL_RUNNER_PID,
)
from sandbox.contracts.record import RECORD_FILE, RunStatus, TestRunRecord, read_record
from sandbox.prepare.dbcopy import copy_db
from sandbox.run.testrun import TestRun
from tests.conftest import WorkflowFactory, tree_digest
from tests.polling import wait_for
from tests.scenarios.faults import (
    DOCKERD_LOG,
    GATED_STEP,
    Runner,
    assert_lock_free,
    assert_nothing_of_the_run_left,
    foreign_running,
    listing,
    processes_of,
    run_cids,
    run_containers,
    run_dirs,
    running_step,
    sandbox_cli,
    start_runner,
)

pytestmark = pytest.mark.engine


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
    # (and marks another session's dead runner's record on this engine: not ours)
    ours = [path for path in report["records_marked_killed"] if path.startswith(str(wf) + "/")]
    assert ours == [str(run_dir)], report["records_marked_killed"]
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
    assert set(again) == {
        "containers_removed",
        "networks_removed",
        "mounts_removed",
        "records_marked_killed",
        "pods_removed",
        "secrets_removed",
        "runs_removed",
        "errors",
    }
    # Nothing of this run or workflow is left to find (another session's may be), and
    # nothing failed.
    assert again["errors"] == []
    assert not [
        item for items in again.values() for item in items if run_id in item or str(wf) in item
    ]

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
