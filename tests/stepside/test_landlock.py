"""The step's Landlock wall: on the host kernel (a process walls itself in, a control
without the wall), then in a real step on the Docker engine."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.collect import stepreports
from sandbox.collect.actionsummary import ActionSummary
from sandbox.contracts.record import Landlock, RunStatus
from sandbox.record import outcome
from sandbox.run.testrun import TestRun
from sandbox.stepside import landlock
from sandbox.stepside.agentworks_exec.interface import LANDLOCK_MARK, LANDLOCK_REFUSED_EXIT
from tests import paths
from tests.conftest import WorkflowFactory

DEADLINE_S = 30.0
ABI = landlock.abi_version()
needs_landlock = pytest.mark.skipif(ABI < 6, reason=f"the kernel's Landlock ABI is {ABI}, not 6+")

# The step scripts' (text) helper: what an attempt ended in, "ok" or the errno's name.
ATTEMPT = r"""
def attempt(action):
    try:
        action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return "ok"
"""

# Run in a fresh interpreter: a Landlock domain can never be left.
ATTEMPTS = (
    r"""
import errno, json, os, socket, sys
from sandbox.stepside import landlock
wall, writable, outside, victim, abstract = sys.argv[1:6]
if wall == "wall":
    landlock.restrict([writable, "/dev/null"])
"""
    + ATTEMPT
    + r"""
def connect():
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect("\0" + abstract)

def write(path):
    with open(path, "a") as handle:
        handle.write("x")

print(json.dumps({
    "write inside": attempt(lambda: write(os.path.join(writable, "made.txt"))),
    "write /dev/null": attempt(lambda: write("/dev/null")),
    "write outside": attempt(lambda: write(outside)),
    "truncate outside": attempt(lambda: os.truncate(outside, 0)),
    "hard link of the outside file inside": attempt(
        lambda: os.link(outside, os.path.join(writable, "linked"))
    ),
    "signal outside": attempt(lambda: os.kill(int(victim), 0)),
    "abstract socket outside": attempt(connect),
}))
"""
)


@pytest.fixture
def outside_world(tmp_path: Path) -> Iterator[tuple[Path, Path, int, str]]:
    """A writable folder, a 0666 file beside it, a process and an abstract socket of
    this test's (all outside any wall), for a child to reach for."""
    writable = tmp_path / "writable"
    writable.mkdir()
    outside = tmp_path / "elsewhere" / "open.txt"
    outside.parent.mkdir()
    outside.write_text("node disk\n")
    outside.chmod(0o666)
    name = f"sandbox-landlock-test-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(4)
    victim = subprocess.Popen(["sleep", "600"])
    try:
        yield writable, outside, victim.pid, name
    finally:
        victim.kill()
        victim.wait(timeout=DEADLINE_S)
        listener.close()


def _attempts(wall: bool, world: tuple[Path, Path, int, str]) -> dict[str, str]:
    writable, outside, victim, name = world
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            ATTEMPTS,
            "wall" if wall else "none",
            *(str(writable), str(outside), str(victim), name),
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=True,
    )
    result: dict[str, str] = json.loads(done.stdout)
    return result


@needs_landlock
def test_the_wall_refuses_writes_links_signals_and_sockets_outside(
    outside_world: tuple[Path, Path, int, str],
) -> None:
    seen = _attempts(True, outside_world)
    assert seen == {
        "write inside": "ok",
        "write /dev/null": "ok",
        "write outside": "EACCES",
        "truncate outside": "EACCES",
        # Linked into the writable folder it would be writable there: refused as such.
        "hard link of the outside file inside": "EXDEV",
        "signal outside": "EPERM",
        "abstract socket outside": "EPERM",
    }
    assert outside_world[1].read_text() == "node disk\n"


def test_without_the_wall_the_same_attempts_succeed(
    outside_world: tuple[Path, Path, int, str],
) -> None:
    """The control: each refusal above is the wall's, not the test's set-up."""
    seen = _attempts(False, outside_world)
    assert set(seen.values()) == {"ok"}, seen


def test_an_abi_without_scopes_scopes_nothing() -> None:
    assert landlock.scopes(5) == 0 and landlock.scope_names(landlock.scopes(6)) == [
        "abstract_unix_socket",
        "signal",
    ]
    assert not landlock.handled_rights(1) & (landlock.REFER | landlock.TRUNCATE)


def _verdict(exit_code: int, wall: Landlock) -> tuple[RunStatus, str]:
    """The run's verdict for a step that exited so behind that wall (its guard up,
    nothing else amiss)."""
    return outcome.status_and_reason(
        exit_code,
        60,
        True,
        None,
        ActionSummary(),
        preflight=None,
        quota_mb=None,
        landlock=wall,
    )


def _executor(tmp_path: Path, mode: str, command: str) -> subprocess.CompletedProcess[str]:
    """The real executor on the host, as the step image runs it (no exec server)."""
    root = tmp_path / "group"
    root.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "AGENTWORKS_LANDLOCK": mode}
    return subprocess.run(
        [sys.executable, "-m", "sandbox.stepside.agentworks_exec", "--", "sh", "-c", command],
        cwd=root,
        env={**env, "PYTHONPATH": str(paths.REPO)},
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )


@pytest.fixture
def beyond_tmp() -> Iterator[Path]:
    """A folder outside /tmp (which the wall leaves writable, and holds tmp_path)."""
    folder = Path(tempfile.mkdtemp(prefix="sandbox-landlock-", dir="/var/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


@needs_landlock
def test_the_executor_walls_the_step_in_before_it_starts(tmp_path: Path, beyond_tmp: Path) -> None:
    outside = beyond_tmp / "outside.txt"
    outside.write_text("")
    outside.chmod(0o666)
    done = _executor(tmp_path, "require", f"echo in > in.txt && echo out > {outside} && echo ran")
    assert done.returncode != 0 and "ran" not in done.stdout
    assert "Permission denied" in done.stderr
    assert (tmp_path / "group" / "in.txt").read_text() == "in\n"
    assert outside.read_text() == ""
    wall = stepreports.landlock_from(done.stderr)
    assert (wall.required, wall.applied, wall.abi) == (True, True, ABI)


def test_a_wall_the_executor_cannot_make_stops_the_step(tmp_path: Path) -> None:
    """A mode it does not know (as a kernel without Landlock): exit 95, no step."""
    done = _executor(tmp_path, "requir", "echo ran > ran.txt")
    assert done.returncode == LANDLOCK_REFUSED_EXIT
    assert not (tmp_path / "group" / "ran.txt").exists()
    assert done.stderr.startswith(LANDLOCK_MARK)
    wall = stepreports.landlock_from(done.stderr)
    assert wall.required and not wall.applied and "neither" in wall.reason
    status, reason = _verdict(done.returncode, wall)
    assert status is RunStatus.ERROR and "never started" in reason and "requir" in reason
    # Exit 95 from a step itself, with the wall up, stays the step's own failure.
    status, _ = _verdict(95, Landlock(required=True, applied=True, abi=ABI))
    assert status is RunStatus.FAILED


@needs_landlock
def test_beside_stdio_servers_a_wall_that_cannot_scope_stops_the_step(tmp_path: Path) -> None:
    """`require-scoped` (a Pod with stdio MCP servers) where the kernel's Landlock cannot
    scope abstract sockets and signals (the wall made as ABI 5 sees it): exit 95 with
    the reason, and the run's verdict says the step never started."""
    code = (
        "import sys; from sandbox.stepside import landlock; landlock.abi_version = lambda: 5;"
        " from sandbox.stepside.agentworks_exec import walls;"
        " sys.exit(walls.gate(sys.argv[1]) or 0)"
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "AGENTWORKS_LANDLOCK": "require-scoped",
        "PYTHONPATH": str(paths.REPO),
    }
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert done.returncode == LANDLOCK_REFUSED_EXIT, done.stderr
    wall = stepreports.landlock_from(done.stderr)
    assert wall.required and wall.applied and wall.abi == 5
    assert "abstract_unix_socket" in wall.reason and "signal" in wall.reason
    status, reason = _verdict(done.returncode, wall)
    assert status is RunStatus.ERROR and "never started" in reason
    # With this kernel's own ABI (6 or later) the same mode walls the step in and runs it.
    ran = _executor(tmp_path, "require-scoped", "echo ran")
    assert ran.returncode == 0 and "ran" in ran.stdout, ran.stderr
    assert stepreports.landlock_from(ran.stderr).scoped == ["abstract_unix_socket", "signal"]


STEP = (
    r"""
import errno, os, sqlite3
"""
    + ATTEMPT
    + r"""
def write(path, text="x"):
    with open(path, "w") as handle:
        handle.write(text)
def db():
    con = sqlite3.connect(os.environ["DB_PATH"])
    con.execute("INSERT INTO t VALUES (2, 'two')")
    con.commit()
    con.close()
for name, action in [
    ("group", lambda: write("made.txt", "made")),
    ("tmp", lambda: write("/tmp/x")),
    ("shm", lambda: write("/dev/shm/x")),
    ("null", lambda: write("/dev/null")),
    ("db", db),
    ("proc", lambda: write("/proc/self/oom_score_adj", "1000")),
]:
    print(name, attempt(action))
"""
)


@pytest.mark.engine
@needs_landlock
def test_a_step_runs_behind_the_wall_and_its_writes_work(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command=["python3", "/workflow/code/step.py"])
    (wf / "code" / "step.py").write_text(STEP)
    record = TestRun(wf, "step1").execute()
    assert record.status is RunStatus.PASSED, record.reason
    wall = record.landlock
    assert (wall.required, wall.applied, wall.abi) == (False, True, ABI), wall
    assert wall.scoped == ["abstract_unix_socket", "signal"]
    seen = dict(line.split() for line in record.stdout.text.splitlines())
    # Unwalled, raising one's own OOM score is allowed; the wall refuses the write.
    assert seen == {
        "group": "ok",
        "tmp": "ok",
        "shm": "ok",
        "null": "ok",
        "db": "ok",
        "proc": "EACCES",
    }
    assert "AGENTWORKS_LANDLOCK_REPORT" not in record.stderr.text
    group = Path(record.workflow_dir) / "runs" / record.id / "g"
    assert (group / "made.txt").read_text() == "made"
    assert record.db_diff is not None
    assert [(t.name, t.inserted) for t in record.db_diff.tables] == [("t", 1)]
