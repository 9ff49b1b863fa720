"""A real test run, end to end, against the real Docker engine."""

from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import docker.errors
import psutil
import pytest
from docker import DockerClient

from sandbox.contracts.names import LABEL_ROLE, LABEL_RUN_ID
from sandbox.contracts.record import RunStatus, TestRunRecord, read_record
from sandbox.run.testrun import RunOptions, TestRun, execute_step
from tests.conftest import WorkflowFactory, containers_of, tree_digest
from tests.polling import wait_for

pytestmark = pytest.mark.engine

STEP_CMD = ["python3", "/workflow/code/step.py"]


def write_step(wf: Path, source: str) -> None:
    (wf / "code" / "step.py").write_text(textwrap.dedent(source))


def run_dir(record: TestRunRecord) -> Path:
    return Path(record.workflow_dir) / "runs" / record.id


def _step_of(engine: DockerClient, workflow: Path) -> list[Any]:
    """The step container of a workflow's running test run (not its guard)."""
    return [c for c in containers_of(engine, workflow) if c.labels.get(LABEL_ROLE) == "step"]


def test_the_memory_peak_comes_from_a_source_the_step_cannot_speak_for(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    """A step that touches 64 MiB and exits at once: the record's peak is at least that,
    and names its source. Under gVisor (`SANDBOX_TEST_WALL=runsc`) the container's cgroup
    is invisible inside, so the figure must be the engine's (the host's read of the
    container's cgroup, or its stats), never the executor's rusage."""
    wf = make_workflow(command=STEP_CMD)
    write_step(
        wf,
        """
        block = b"\\x01" * (64 << 20)
        print("TOUCHED", len(block))
        """,
    )
    record = TestRun(wf, "step1").execute()

    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    assert f"TOUCHED {64 << 20}" in record.stdout.text
    peak, source = record.resources.peak_memory_bytes, record.resources.peak_memory_source
    assert peak is not None and peak >= 64 << 20, (peak, source)
    if record.walls.step_runtime == "runsc":
        assert source == "host_cgroup", (peak, source)
    else:
        assert source in ("container_cgroup", "engine_stats", "executor_rusage"), source


def test_example_step_runs_in_test_mode(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(
        command=STEP_CMD,
        earlier_files={"data/in.json": '{"n": 41}'},
        prompt="Do the thing.\n",
    )
    write_step(
        wf,
        """
        import json, os, sqlite3, pathlib
        n = json.loads(pathlib.Path("data/in.json").read_text())["n"]
        pathlib.Path("out.txt").write_text(str(n + 1))
        db = sqlite3.connect(os.environ["DB_PATH"])
        db.execute("UPDATE t SET v = 'uno' WHERE id = 1")
        db.execute("INSERT INTO t VALUES (2, 'two')")
        db.commit()
        prompt = pathlib.Path(os.environ["AGENTWORKS_PROMPT_FILE"]).read_text()
        print("ENV", os.environ["AGENTWORKS_TEST_MODE"], os.environ["AGENTWORKS_TEST_RUN_ID"])
        print("STEP", os.environ["AGENTWORKS_TEST_STEP_ID"], os.environ["AGENTWORKS_TEST_STEP_RUN_ID"])
        print("PROMPT_HAS_SECTION", "## TEST MODE" in prompt, prompt.startswith("Do the thing."))
        print("UID", os.getuid(), "CWD", os.getcwd())
        """,
    )
    before = tree_digest(wf)
    record = execute_step(wf, "step1", test_mode=True)

    assert record.status is RunStatus.PASSED, record.stderr.text
    assert record.exit_code == 0
    assert f"ENV 1 {record.id}" in record.stdout.text
    assert f"STEP step1 {record.id}" in record.stdout.text  # alone, the step is the run
    assert "PROMPT_HAS_SECTION True True" in record.stdout.text
    assert "UID 10001 CWD /test/g" in record.stdout.text
    assert record.files.created == ["out.txt"]
    assert (run_dir(record) / "g" / "out.txt").read_text() == "42"
    assert record.copy_report is not None and record.copy_report.files_copied == 1
    assert record.db_diff is not None
    table = {t.name: t for t in record.db_diff.tables}["t"]
    assert (table.inserted, table.updated, table.deleted) == (1, 1, 0)
    assert record.resources.peak_memory_bytes and record.resources.peak_memory_bytes > 0
    assert (run_dir(record) / "test_mode_actions.jsonl").read_text() == ""
    # The record on disk is the same model, and the real workflow is untouched.
    assert read_record(run_dir(record)).model_dump() == record.model_dump()
    assert tree_digest(wf) == before
    assert sqlite3.connect(wf / "db" / "db.sqlite").execute("SELECT v FROM t").fetchall() == [
        ("one",)
    ]


def test_hostile_step_cannot_change_the_real_workflow(
    engine: DockerClient, make_workflow: WorkflowFactory, tmp_path: Path
) -> None:
    crew = tmp_path / "crew-a"
    crew.mkdir()
    (crew / "crew.txt").write_text("crew data")
    wf = make_workflow(
        command=STEP_CMD,
        earlier_files={"keep.txt": "k", "gone.txt": "bye"},
        extra_toml=f'[[crew_folders]]\nname = "a"\npath = "{crew}"\n',
        prompt="p",
    )
    # WAL mode with committed rows not yet checkpointed into the main file.
    con = sqlite3.connect(wf / "db" / "db.sqlite")
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("INSERT INTO t VALUES (7, 'wal-row')")
    con.commit()
    assert (wf / "db" / "db.sqlite-wal").stat().st_size > 0
    write_step(
        wf,
        """
        import json, os, sqlite3, pathlib, glob, shutil
        results = {}
        def attempt(name, fn):
            try:
                fn(); results[name] = "WROTE"
            except Exception as exc:
                results[name] = type(exc).__name__
        targets = ["/workflow/workflow.toml", "/workflow/db/db.sqlite", "/workflow/db/db.sqlite-wal",
                   "/workflow/new.txt", "/workflow/runs/run-1/g/execution/keep.txt",
                   "/crew/a/crew.txt", "/test/prompt.md", "/etc/passwd", "/usr/bin/evil",
                   "/workflow/code/step.py"]
        for t in targets:
            attempt("write " + t, lambda t=t: open(t, "a").write("x"))
        run_root = "/workflow/runs/" + os.environ["AGENTWORKS_TEST_RUN_ID"]
        attempt("forge record", lambda: open(run_root + "/test_mode.json", "w").write("{}"))
        attempt("forge log", lambda: open(run_root + "/test_mode_actions.jsonl", "a").write("{}"))
        attempt("rm real db", lambda: os.unlink("/workflow/db/db.sqlite"))
        attempt("rmtree code", lambda: shutil.rmtree("/workflow/code"))
        attempt("rm crew", lambda: os.unlink("/crew/a/crew.txt"))
        os.unlink("gone.txt")
        db = sqlite3.connect(os.environ["DB_PATH"])
        seen = [r[0] for r in db.execute("SELECT id FROM t ORDER BY id")]
        db.execute("DELETE FROM t")
        db.execute("CREATE TABLE evil (x)")
        db.commit()
        results["copy rows before rewrite"] = seen
        print(json.dumps(results))
        """,
    )
    before = tree_digest(wf)
    record = execute_step(wf, "step1")
    assert record.status is RunStatus.PASSED, record.stderr.text
    results = json.loads(record.stdout.text.strip().splitlines()[-1])
    wrote = [k for k, v in results.items() if v == "WROTE"]
    assert wrote == [], wrote
    assert results["copy rows before rewrite"] == [1, 7]  # committed WAL row is in the copy
    assert tree_digest(wf) == before
    assert record.files.deleted == ["gone.txt"]
    assert record.db_diff is not None and "evil" in record.db_diff.tables_added
    real = sqlite3.connect(f"file:{wf / 'db' / 'db.sqlite'}?mode=ro", uri=True)
    assert [r[0] for r in real.execute("SELECT id FROM t ORDER BY id")] == [1, 7]
    con.close()


def test_uncommitted_rows_of_an_open_writer_are_not_copied(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command=STEP_CMD)
    write_step(
        wf,
        """
        import os, sqlite3
        print(sorted(r[0] for r in sqlite3.connect(os.environ["DB_PATH"]).execute("SELECT id FROM t")))
        """,
    )
    writer = sqlite3.connect(wf / "db" / "db.sqlite", isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("INSERT INTO t VALUES (2, 'committed')")
    writer.execute("BEGIN")
    writer.execute("INSERT INTO t VALUES (3, 'uncommitted')")
    try:
        record = execute_step(wf, "step1")
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert record.stdout.text.strip() == "[1, 2]"


def test_container_is_hardened(engine: DockerClient, make_workflow: WorkflowFactory) -> None:
    wf = make_workflow(command=STEP_CMD)
    write_step(
        wf,
        """
        import json, socket, os
        status = dict(l.split(":\\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\\t" in l)
        ifaces = sorted(os.listdir("/sys/class/net"))
        try:
            open("/rootfs-probe", "w"); rootfs = "writable"
        except OSError:
            rootfs = "read-only"
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=1); net = "connected"
        except OSError as exc:
            net = type(exc).__name__
        masked = {p: len(open(p, "rb").read()) if os.path.exists(p) else "absent" for p in ("/proc/kallsyms", "/proc/config.gz", "/sys/kernel/vmcoreinfo")}
        cgroups = {line.rsplit(":", 1)[1] for line in open("/proc/self/cgroup").read().splitlines()}
        ping_file = "/proc/sys/net/ipv4/ping_group_range"
        ping = open(ping_file).read().split() if os.path.exists(ping_file) else "absent"
        import ctypes
        prctl = ctypes.CDLL(None).prctl  # gVisor's status lacks these lines: ask the kernel
        status.setdefault("NoNewPrivs", str(prctl(39, 0, 0, 0, 0)))  # PR_GET_NO_NEW_PRIVS
        status.setdefault("Seccomp", str(prctl(21, 0, 0, 0, 0)))  # PR_GET_SECCOMP
        print(json.dumps({"CapEff": status["CapEff"].strip(), "NoNewPrivs": status["NoNewPrivs"].strip(),
            "Seccomp": status["Seccomp"].strip(), "ifaces": ifaces, "rootfs": rootfs, "uid": os.getuid(),
            "net": net, "masked": masked, "cgroups": sorted(cgroups), "ping": ping}))
        """,
    )
    record = execute_step(wf, "step1")
    assert record.status is RunStatus.PASSED, record.stderr.text
    facts = json.loads(record.stdout.text)
    # The range is the kernel's empty default [1, 0] in host gids; a remapped user
    # namespace shows host gids it does not map as the overflow gid.
    empty_ping_range: list[str] | str = (
        ["65534", "65534"] if record.walls.userns_remap else ["1", "0"]
    )
    # gVisor has no such files to mask (its /proc and /sys are the sentry's own).
    gvisor = record.walls.step_runtime == "runsc"
    hidden: int | str = "absent" if gvisor else 0
    if gvisor:  # no ICMP sockets at all there (EAFNOSUPPORT), and no such setting
        empty_ping_range = "absent"
    assert facts == {
        "CapEff": "0000000000000000",
        "NoNewPrivs": "1",
        "Seccomp": "2",
        "ifaces": ["lo"],
        "rootfs": "read-only",
        "uid": 10001,
        "net": "ConnectionRefusedError",
        "masked": {
            "/proc/kallsyms": hidden,
            "/proc/config.gz": hidden,
            "/sys/kernel/vmcoreinfo": hidden,
        },
        # A private cgroup namespace: the host's hierarchy is not visible (under gVisor
        # there is no cgroup at all in the step's view).
        "cgroups": [] if gvisor else ["/"],
        "ping": empty_ping_range,  # no group may open ICMP sockets
    }


def test_timeout_kills_the_step_and_its_children(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    marker = "sandbox-timeout-marker-5821"
    # The child's argument is this test's own (a fraction no one else sleeps), so a
    # `sleep 300` of another user of the shared host is never taken for a leftover.
    child = ["sleep", f"300.{secrets.randbelow(10**6):06d}"]
    code = f"import subprocess, time; subprocess.Popen({child!r}); time.sleep(301)  # {marker}"
    wf = make_workflow(command=["python3", "-c", code], timeout_s=1)
    record = execute_step(wf, "step1")
    assert record.status is RunStatus.TIMEOUT
    assert "timeout" in record.reason
    assert not engine.containers.list(all=True, filters={"label": f"{LABEL_RUN_ID}={record.id}"})
    leftovers = [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if p.info["cmdline"]
        and (marker in " ".join(p.info["cmdline"]) or p.info["cmdline"] == child)
    ]
    assert leftovers == []


def test_second_test_run_of_a_workflow_is_refused_while_one_runs(
    engine: DockerClient, make_workflow: WorkflowFactory, tmp_path: Path
) -> None:
    busy = make_workflow("busy", command="sleep 120", timeout_s=60)
    other = make_workflow("other", command="true")
    results: list[TestRunRecord] = []
    first = threading.Thread(
        target=lambda: results.append(TestRun(busy, "step1", RunOptions(timeout_s=300)).execute())
    )
    first.start()
    try:
        wait_for(lambda: bool(containers_of(engine, busy)), 60, "the first run's container")
        refused = subprocess.run(
            [sys.executable, "-m", "sandbox.cli", "run", str(busy), "step1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert "refused" in refused.stdout
        assert "pid" in refused.stdout  # says who holds the lock
        assert execute_step(other, "step1").status is RunStatus.PASSED
    finally:
        # Only the step: the runner must still find its guard running to call the run
        # FAILED (a guard that stopped first makes it ERROR), and it stops the guard.
        wait_for(lambda: bool(_step_of(engine, busy)), 60, "the first run's step")
        for container in _step_of(engine, busy):
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                container.kill()
        first.join(timeout=120)
    assert results and results[0].status is RunStatus.FAILED


def test_symlink_in_execution_tree_is_copied_as_a_link_and_never_read(
    engine: DockerClient, make_workflow: WorkflowFactory, tmp_path: Path
) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-SECRET-7731")
    wf = make_workflow(command=STEP_CMD, earlier_files={"a.txt": "a"})
    execution = wf / "runs" / "run-1" / "g" / "execution"
    (execution / "leak").symlink_to(secret)
    (execution / "etc-passwd").symlink_to("/etc/passwd")
    write_step(
        wf,
        """
        import os
        os.symlink("/workflow/workflow.toml", "planted")   # the step plants its own link too
        try:
            print(open("leak").read())
        except OSError as exc:
            print("cannot follow:", type(exc).__name__)
        """,
    )
    record = execute_step(wf, "step1")
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert "HOST-SECRET" not in record.stdout.text  # the target is not in the sandbox
    copied = run_dir(record) / "g" / "leak"
    assert copied.is_symlink() and Path(copied.readlink()) == secret
    assert record.copy_report is not None
    assert {s.path for s in record.copy_report.symlinks} == {"leak", "etc-passwd"}
    assert "planted" in record.files.created
    record_text = (run_dir(record) / "test_mode.json").read_text()
    assert "HOST-SECRET" not in record_text


def test_copy_cap_leaves_out_what_does_not_fit(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command="true", earlier_files={}, extra_toml="[limits]\ncopy_cap_mb = 5\n")
    execution = wf / "runs" / "run-1" / "g" / "execution"
    for i in range(6):  # 6 x 1 MiB of data = 6 MiB, past the 5 MiB cap
        (execution / f"blob{i}.bin").write_bytes(bytes([i]) * 1024**2)
    # A hole costs the cap nothing: 1 GiB of it is copied, as a hole.
    with (execution / "hole.bin").open("wb") as handle:
        handle.truncate(1024**3)
    record = execute_step(wf, "step1")
    assert record.status is RunStatus.PASSED
    report = record.copy_report
    assert report is not None
    assert report.bytes_copied <= 5 * 1024**2
    assert report.files_copied == 6
    assert [entry.path for entry in report.left_out] == ["blob5.bin"]
    group = run_dir(record) / "g"
    copied = sum(p.stat().st_size for p in group.iterdir() if p.name != "hole.bin")
    assert copied == report.bytes_copied
    assert (group / "hole.bin").stat().st_size == 1024**3
    assert (group / "hole.bin").stat().st_blocks == 0


def test_no_earlier_run_and_no_db(engine: DockerClient, make_workflow: WorkflowFactory) -> None:
    wf = make_workflow(command=STEP_CMD, db_sql=None)
    write_step(
        wf,
        'import os, sys; print(sorted(os.listdir(".")), "DB_PATH" in os.environ, os.path.exists("/test/db"))',
    )
    record = execute_step(wf, "step1")
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert record.no_earlier_run and record.no_db
    assert record.stdout.text.strip() == "[] False False"
