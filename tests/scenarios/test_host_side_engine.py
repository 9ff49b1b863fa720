"""The host side never trusts what the step left (each a real test run on the real engine).

Links the step plants are never followed (an inotify canary on a host folder sees no
open), the disk quota is a wall the kernel holds (five ways of writing past it), deep
and odd trees neither crash the runner nor escape `sandbox gc`, the step cannot see the
real DB or any test run's folder, its writable mounts are `nosuid,nodev`, and what the
record and the CLI say is what a user can act on.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sqlite3
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.collect import dbdiff
from sandbox.contracts.names import LABEL_RUN_ID
from sandbox.contracts.record import RunStatus, TestRunRecord, read_record
from sandbox.contracts.reports import DbDiff
from sandbox.contracts.status import ACTIONS_FILE
from sandbox.guard.egress.transparent import FIRST_READ_S
from sandbox.run.testrun import TestRun
from tests.conftest import ThreadedRun, WorkflowFactory, call_lines, tree_digest
from tests.fakes.harness import outside_server

pytestmark = pytest.mark.engine

STEP_CMD = ["python3", "/workflow/code/step.py"]
QUOTA_MB = 24


def write_step(wf: Path, source: str) -> None:
    (wf / "code" / "step.py").write_text(textwrap.dedent(source))


def mounts_naming(text: str) -> list[str]:
    """The runner's mount table lines that name ``text``."""
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if text in line]


def run_dir(record: TestRunRecord) -> Path:
    return Path(record.workflow_dir) / "runs" / record.id


# -- an inotify canary: proves no host file or folder was opened ------------------------------

_IN_ACCESS, _IN_OPEN, _IN_NONBLOCK = 0x1, 0x20, 0o4000
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class Canary:
    """A host folder tree whose every open (of a folder or a file) is counted."""

    NAMES = ("secret-alpha", "secret-beta", "secret-gamma")

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        for name in self.NAMES:
            (root / name).mkdir()
            (root / name / f"{name}.txt").write_text("host secret")
        self._fd = _libc.inotify_init1(_IN_NONBLOCK)
        assert self._fd >= 0
        for path in [root, *(root / n for n in self.NAMES)]:
            assert _libc.inotify_add_watch(self._fd, str(path).encode(), _IN_OPEN | _IN_ACCESS) >= 0

    def opened(self) -> list[str]:
        """What was opened since the last look (names of the events)."""
        found: list[str] = []
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return found
            offset = 0
            while offset < len(data):
                _wd, mask, _cookie, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode()
                found.append(f"{mask:#x} {name or '.'}")
                offset += 16 + length

    def close(self) -> None:
        os.close(self._fd)


@pytest.fixture
def canary(tmp_path: Path) -> Iterator[Canary]:
    watched = Canary(tmp_path / "host-canary")
    yield watched
    watched.close()


def test_links_the_step_planted_are_never_followed_by_the_host(
    engine: DockerClient, make_workflow: WorkflowFactory, canary: Canary
) -> None:
    wf = make_workflow(command=STEP_CMD, earlier_files={"in.txt": "x"})
    write_step(
        wf,
        f"""
        import os, time
        host = {str(canary.root)!r}
        os.symlink(host, "to-host")                       # a folder link
        os.symlink(host + "/../host-canary", "to-host-again")
        os.makedirs("deep/er")
        os.symlink(host, "deep/er/to-host")
        os.symlink(host, "/test/db/db.sqlite-wal")        # beside the DB copy
        os.symlink(host, "/test/db/db.sqlite-journal")
        os.makedirs("swap/inner")
        open("swap/inner/f", "w").write("x")
        time.sleep(1.0)                                   # the host looks meanwhile
        os.rename("swap", "swapped-away")
        os.symlink(host, "swap")                          # a folder swapped for a link
        time.sleep(0.5)
        """,
    )
    canary.opened()  # the set-up's own opens
    record = TestRun(wf, "step1").execute()
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    assert canary.opened() == [], "the host side opened the host canary through a planted link"
    # The names inside the host folder are the host's; the step never saw them.
    text = (run_dir(record) / "test_mode.json").read_text()
    for name in Canary.NAMES:
        assert name not in text, f"the record names the host's {name}"
    assert "to-host" in record.files.created and "swap" in record.files.created
    # The links reached the run folder as links.
    assert os.readlink(run_dir(record) / "g" / "to-host") == str(canary.root)


# -- the disk quota is a wall -----------------------------------------------------------------

HOLD = "time.sleep(30)  # a hostile step keeps going; the run must stop it\n"

QUOTA_WAYS = {
    "plain": """
        block = os.urandom(1 << 20)
        with open("fill.bin", "wb") as f:
            try:
                for _ in range(1000):
                    f.write(block); f.flush()
            except OSError as exc:
                print("wall", exc.errno)
        """,
    "fast": """
        import threading
        def fill(i):
            try:
                with open(f"/tmp/fast{i}", "wb") as f:
                    f.write(bytes(200 << 20))
            except OSError as exc:
                print("wall", exc.errno)
        ts = [threading.Thread(target=fill, args=(i,)) for i in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        """,
    "sparse": """
        fd = os.open("scattered.bin", os.O_WRONLY | os.O_CREAT)
        try:
            for i in range(4000):
                os.pwrite(fd, os.urandom(64 << 10), i * (1 << 24))
        except OSError as exc:
            print("wall", exc.errno)
        """,
    "deleted but open": """
        f = open("/test/db/ghost", "wb")
        os.unlink("/test/db/ghost")
        try:
            for _ in range(1000):
                f.write(bytes(1 << 20)); f.flush()
        except OSError as exc:
            print("wall", exc.errno)
        """,
    "many small files": """
        os.mkdir("many")
        try:
            for i in range(500_000):
                with open(f"many/{i}", "wb") as f:
                    f.write(b"x")
        except OSError as exc:
            print("wall", exc.errno)
        """,
}


def _allocated(root: Path) -> int:
    """Bytes the host's disk gives everything below ``root`` (fd walk, links not followed)."""
    total = 0
    for _dirpath, dirnames, filenames, dirfd in os.fwalk(root, follow_symlinks=False):
        for name in [*dirnames, *filenames]:
            with contextlib.suppress(OSError):
                total += os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_blocks * 512
    return total


@pytest.mark.parametrize("way", list(QUOTA_WAYS))
def test_writing_past_the_quota_meets_a_wall_and_the_run_is_quota(
    engine: DockerClient, make_workflow: WorkflowFactory, way: str
) -> None:
    wf = make_workflow(
        command=STEP_CMD,
        db_sql="CREATE TABLE t (id INTEGER PRIMARY KEY);",
        extra_toml=f"[limits]\ndisk_quota_mb = {QUOTA_MB}\n",
    )
    write_step(wf, "import os, time\n" + textwrap.dedent(QUOTA_WAYS[way]) + HOLD)
    quota = QUOTA_MB * 1024**2
    peak = [0]
    with ThreadedRun(wf) as run:
        # The host disk the run takes while the step writes: its disk image's blocks.
        while not run.finished:
            for image in (wf / "runs").glob("test-*/.disk.img"):
                with contextlib.suppress(OSError):
                    peak[0] = max(peak[0], image.stat().st_blocks * 512)
            time.sleep(0.01)
    record = run.record
    assert record.status is RunStatus.QUOTA, (way, record.reason, record.stdout.text)
    assert f"quota of {QUOTA_MB} MB" in record.reason
    # The step phase alone: a slow launch or clean-up on a loaded machine is not the step.
    assert record.phases.step_s < 25, "the step was not stopped"
    assert peak[0] <= quota * 1.01, f"the disk image took {peak[0]} bytes"
    assert _allocated(run_dir(record)) <= quota * 1.01 + 256 * 1024
    assert record.disk_used_bytes is not None and record.disk_used_bytes <= quota


def test_a_sparse_wal_stays_a_hole_and_costs_the_host_nothing(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command=STEP_CMD, extra_toml=f"[limits]\ndisk_quota_mb = {QUOTA_MB}\n")
    write_step(
        wf,
        """
        import os
        for name, size in (("db.sqlite-wal", 1536 << 20), ("db.sqlite-journal", 1 << 30)):
            with open("/test/db/" + name, "wb") as f:
                f.truncate(size)
        """,
    )
    record = TestRun(wf, "step1").execute()
    assert record.status is RunStatus.PASSED, record.reason
    assert record.db_diff is not None and record.db_diff.error is None
    assert record.phases.collect_s < 5
    wal = run_dir(record) / "db" / "db.sqlite-wal"
    assert wal.stat().st_size == 1536 << 20 and wal.stat().st_blocks == 0
    assert _allocated(run_dir(record)) < 4 * 1024**2


# -- deep, wide and odd trees -----------------------------------------------------------------


def _inotify_watches(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/fdinfo/{fd}") as handle:
            count += sum(1 for line in handle if line.startswith("inotify wd:"))
    return count


def test_deep_wide_and_odd_trees_end_in_a_record_and_gc_deletes_them(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command=STEP_CMD)
    write_step(
        wf,
        """
        import os
        fd = os.open(".", os.O_RDONLY)
        for _ in range(1500):                   # a chain deeper than any recursion limit
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        open(os.open("bottom", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd), "w").write("x")
        for i in range(8000):                   # many folders: no watch each
            os.makedirs(f"wide/{i // 100}/{i}")
        os.mkdir(b"odd\\n\\x1b[31m\\xff name")
        os.mkdir("locked"); open("locked/inside", "w").write("x"); os.chmod("locked", 0)
        print("made")
        """,
    )
    watches_before = _inotify_watches(os.getpid())
    with ThreadedRun(wf) as run:
        while not run.finished:
            assert _inotify_watches(os.getpid()) <= watches_before + 16
            time.sleep(0.05)
    record = run.record
    assert record.status is RunStatus.PASSED, record.reason
    assert record.files.truncated  # more created than a record lists
    group = run_dir(record) / "g"
    assert (group / "locked").stat().st_mode & 0o777 == 0
    # `sandbox list` never shows a finished run as running; `sandbox gc --remove-runs`
    # deletes what the step made, whatever its shape.
    listed = _cli("list", str(wf))
    assert record.id in listed.stdout and "running" not in listed.stdout
    gc = _cli("gc", "--remove-runs", str(wf))
    assert gc.returncode == 0, gc.stderr
    assert not run_dir(record).exists(), gc.stdout


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# -- what the step sees of the workflow folder ------------------------------------------------


def test_the_step_sees_neither_the_real_db_nor_any_test_run(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command=STEP_CMD, earlier_files={"in.txt": "x"})
    (wf / "knowledgebase").mkdir()
    (wf / "knowledgebase" / "a.md").write_text("real knowledge")
    write_step(wf, "print('an earlier test run')")
    first = TestRun(wf, "step1").execute()  # an earlier test run, with its record
    assert first.status is RunStatus.PASSED
    write_step(
        wf,
        """
        import json, os, pathlib, sqlite3, time
        seen = {
            "top": sorted(os.listdir("/workflow")),
            "runs": sorted(os.listdir("/workflow/runs")),
            "kb": pathlib.Path("/workflow/knowledgebase/a.md").read_text(),
            "real run": pathlib.Path("/workflow/runs/run-1/g/execution/in.txt").read_text(),
        }
        try:
            con = sqlite3.connect("file:/workflow/db/db.sqlite?mode=ro", uri=True)
            con.execute("BEGIN")
            con.execute("SELECT count(*) FROM t").fetchone()   # would hold a read lock
            seen["db"] = "open"
        except sqlite3.Error as exc:
            seen["db"] = str(exc)
        print(json.dumps(seen))
        pathlib.Path("ready").write_text("1")
        deadline = time.time() + 30
        while not os.path.exists("go") and time.time() < deadline:
            time.sleep(0.02)
        """,
    )
    with ThreadedRun(wf) as run:
        ready = run.wait_for_in_group("ready")
        # A real writer with a 2 s busy timeout is never blocked by the step.
        writer = sqlite3.connect(wf / "db" / "db.sqlite", timeout=2)
        writer.execute("INSERT INTO t (v) VALUES ('real write')")
        writer.commit()
        writer.close()
        (ready.parent / "go").write_text("1")
    record = run.record
    assert record.status is RunStatus.PASSED, record.reason
    import json

    seen = json.loads(record.stdout.text.strip().splitlines()[-1])
    assert "db" not in seen["top"]
    assert seen["runs"] == ["run-1"], "test runs (earlier ones and this one) are visible"
    assert seen["kb"] == "real knowledge" and seen["real run"] == "x"
    assert seen["db"] == "unable to open database file"


# -- mounts: nosuid, nodev ---------------------------------------------------------------------


def test_the_steps_writable_mounts_are_nosuid_nodev_and_leave_no_setuid_file(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command=STEP_CMD)
    write_step(
        wf,
        """
        import os, shutil, socket, stat
        shutil.copy("/bin/true", "suid-true")
        os.chmod("suid-true", 0o6755)
        os.mkfifo("a-fifo")
        s = socket.socket(socket.AF_UNIX); s.bind("a-socket")
        for line in open("/proc/self/mountinfo"):
            fields = line.split()
            if fields[4] in ("/test/g", "/test/db", "/tmp"):
                print("MOUNT", fields[4], fields[5])
        print("MODE", oct(os.stat("suid-true").st_mode & 0o7777))
        """,
    )
    record = TestRun(wf, "step1").execute()
    assert record.status is RunStatus.PASSED, record.reason
    mounts = {
        line.split()[1]: line.split()[2].split(",")
        for line in record.stdout.text.splitlines()
        if line.startswith("MOUNT")
    }
    assert sorted(mounts) == ["/test/db", "/test/g", "/tmp"], record.stdout.text
    for target, options in mounts.items():
        assert "nosuid" in options and "nodev" in options, (target, options)
    group = run_dir(record) / "g"
    assert (group / "suid-true").stat().st_mode & 0o7000 == 0
    assert not (group / "a-fifo").exists() and not (group / "a-socket").exists()
    assert record.export_report is not None and record.export_report.skipped_special_count == 2


# -- messages a user can act on ----------------------------------------------------------------


def test_an_oom_kill_says_the_memory_limit(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command=STEP_CMD, extra_toml="[limits]\nmemory_mb = 96\n", db_sql=None)
    write_step(
        wf,
        """
        hog = []
        while True:
            hog.append(bytearray(8 << 20))
        """,
    )
    record = TestRun(wf, "step1").execute()
    assert record.status is RunStatus.FAILED
    assert "memory limit of 96 MB reached" in record.reason, record.reason


def test_a_connect_forced_onto_lo_lands_on_the_guard_and_is_closed_at_once(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    """A socket bound to lo (SO_BINDTODEVICE) towards an outside address is redirected to
    the guard like any other connection: bytes that are neither HTTP nor TLS are refused,
    recorded and the connection closed at once (it neither hangs nor gets out)."""
    with outside_server(engine) as outside:
        wf = make_workflow(command=STEP_CMD, db_sql=None)
        write_step(
            wf,
            f"""
            import socket, time
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
            s.settimeout(10)
            t0 = time.monotonic()
            try:
                s.connect(({outside.ipv4!r}, 9))
                s.sendall(b"forced-onto-lo")
                print("CLOSED", len(s.recv(100)), round(time.monotonic() - t0, 2))
            except OSError as exc:
                print("ERR", type(exc).__name__, round(time.monotonic() - t0, 2))
            """,
        )
        record = TestRun(wf, "step1").execute()
        assert outside.seen() == [] and outside.raw() == []
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    words = record.stdout.text.split()
    assert words[:2] in (["CLOSED", "0"], ["ERR", "ConnectionResetError"]), record.stdout.text
    assert float(words[-1]) < FIRST_READ_S  # closed before the guard's first-read wait ended
    lines = call_lines(Path(record.workflow_dir) / "runs" / record.id / ACTIONS_FILE)
    (line,) = [ln for ln in lines if ln.tool == "http"]
    assert line.decision == "refuse" and line.detail["via"] == "direct"
    assert line.detail["destination"] == f"{outside.ipv4}:9"


def test_the_cli_prints_what_the_step_chose_terminal_safe(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command=STEP_CMD, db_sql=None)
    write_step(
        wf,
        """
        import agentworks_bridge, sys
        agentworks_bridge.call("\\x1b]0;owned\\x07notify\\x1b[2J", {"text": "\\x00hi"})
        print("out \\x1b[31mred\\x1b[0m \\x1b]52;c;Zm9v\\x07 \\u202e")
        sys.stderr.write("err \\x1b[1A\\x00\\n")
        """,
    )
    record = TestRun(wf, "step1").execute()
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    shown = _cli("show", str(run_dir(record)))
    assert shown.returncode == 0, shown.stderr
    for raw in ("\x1b", "\x07", "\x00", "\u202e"):
        assert raw not in shown.stdout, f"{raw!r} reached the terminal"
    assert "\\x1b]0;owned\\x07notify" in shown.stdout
    assert "\\x1b[31mred" in shown.stdout


# -- a record always ends ----------------------------------------------------------------------


def test_an_unexpected_error_in_collect_still_ends_the_record(
    engine: DockerClient, make_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    wf = make_workflow(command="true")

    def broken(*args: object, **kwargs: object) -> DbDiff:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(dbdiff, "diff_databases", broken)
    before = tree_digest(wf)
    record = TestRun(wf, "step1").execute()
    assert record.status is RunStatus.ERROR
    assert record.reason.startswith("internal error during collect: RecursionError")
    on_disk = read_record(run_dir(record))
    assert on_disk.status is RunStatus.ERROR and on_disk.finished_at is not None
    assert tree_digest(wf) == before
    assert mounts_naming(record.id) == [], "a mount outlived the run"
    left = engine.containers.list(all=True, filters={"label": f"{LABEL_RUN_ID}={record.id}"})
    assert left == []


def test_the_cli_never_prints_a_traceback(
    make_workflow: WorkflowFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sandbox import cli

    wf = make_workflow(command="true")

    def broken(self: object) -> TestRunRecord:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(TestRun, "execute", broken)
    code = cli.main(["run", str(wf), "step1"])
    err = capsys.readouterr().err
    assert code == 6  # an internal error
    assert "Traceback" not in err and err.strip() == "sandbox: internal error: RuntimeError: boom"


def test_list_never_shows_running_for_a_dead_runner(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command="true")
    record = TestRun(wf, "step1").execute()
    stale = record.model_copy(update={"status": RunStatus.RUNNING, "finished_at": None})
    assert stale.runner is not None
    stale.runner = stale.runner.model_copy(update={"pid": 2**22 - 1})
    from sandbox.contracts.record import write_record

    write_record(run_dir(record), stale)
    listed = _cli("list", str(wf))
    assert "killed" in listed.stdout and " running" not in listed.stdout, listed.stdout


def test_gc_unmounts_what_a_dead_runner_left(
    engine: DockerClient, make_workflow: WorkflowFactory, tmp_path: Path
) -> None:
    """A runner SIGKILLed mid-run leaves its disk and view mounted: gc removes both."""
    wf = make_workflow(command="sleep 60", db_sql=None)
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from sandbox.run.testrun import TestRun
        TestRun(Path({str(wf)!r}), "step1").execute()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 120
        while not [m for m in mounts_naming(str(wf)) if ".disk" in m]:
            assert time.monotonic() < deadline and proc.poll() is None, "the run never mounted"
            time.sleep(0.05)
        time.sleep(0.5)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    gc = _cli("gc", str(wf))
    assert gc.returncode == 0, gc.stderr
    assert mounts_naming(str(wf)) == []
    assert list((wf / "runs").glob("test-*/.disk.img")) == []
    (root,) = list((wf / "runs").glob("test-*"))
    assert read_record(root).status is RunStatus.KILLED
    assert (
        "loop"
        not in subprocess.run(
            ["losetup", "-j", str(root / ".disk.img")], capture_output=True, text=True
        ).stdout
    )
