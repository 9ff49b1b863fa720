"""Escape battery, run 3 of 3: resource exhaustion, then kill(-1, SIGKILL).

The workflow sets small limits so each bomb hits its fence quickly: a fork
bomb and a thread bomb against the pids limit, a memory bomb (in a child)
against the memory limit, /tmp and /dev/shm filled to ENOSPC, two busy
processes against the CPU quota. The guard must still answer afterwards.
Last, the step sends SIGKILL to every process it can signal: only its own
container dies (the guard lives in another pid namespace), so the run ends
as a failed step, not as an error with a dead guard.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from docker import DockerClient

from sandbox.contracts.record import RunStatus
from sandbox.contracts.wire import ActionLine
from tests.security.conftest import (
    Battery,
    assert_attempts_match,
    assert_left_no_trace,
    build_workflow,
    check,
    run_battery,
)

pytestmark = pytest.mark.engine

MEMORY_MB = 256
PIDS = 64
TMPFS_MB = 16
SHM_MB = 64  # the engine's default /dev/shm size

STEP = r"""
import threading, time
import agentworks_bridge

PIDS, TMPFS_MB, SHM_MB = @@PIDS@@, @@TMPFS_MB@@, @@SHM_MB@@


def fork_bomb():
    # Children block on a pipe; closing its write end releases them all at once.
    sys.stdout.flush()
    r, w = os.pipe()
    children, outcome, detail = [], "NO LIMIT HIT", ""
    for _ in range(2000):
        try:
            pid = os.fork()
        except OSError as exc:
            outcome, detail = errname(exc), str(exc)
            break
        if pid == 0:
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        children.append(pid)
    os.close(w)
    os.close(r)
    for pid in children:
        os.waitpid(pid, 0)
    return outcome, detail, {"forks": len(children)}


def fork_after_bomb():
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    return "forks again" if os.WEXITSTATUS(status) == 7 else "BROKEN"


def thread_bomb():
    stop = threading.Event()
    threads, outcome = [], "NO LIMIT HIT"
    for _ in range(2000):
        thread = threading.Thread(target=stop.wait)
        try:
            thread.start()
        except RuntimeError:
            outcome = "RuntimeError"
            break
        threads.append(thread)
    stop.set()
    for thread in threads:
        thread.join()
    return outcome, "", {"threads": len(threads)}


def memory_bomb():
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        chunks = []
        try:
            for _ in range(512):  # at most 4 GiB, far above the limit
                chunks.append(b"\1" * (8 << 20))
        except MemoryError:
            os._exit(4)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name, "the child was killed; the parent lives"
    return "exit %d" % os.WEXITSTATUS(status)


def fill(path, cap_mb):
    def go():
        chunk = b"\1" * (1 << 20)
        written, outcome = 0, "NO LIMIT HIT"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while written < (cap_mb + 64) << 20:
                try:
                    written += os.write(fd, chunk)
                except OSError as exc:
                    outcome = errname(exc)
                    break
        finally:
            os.close(fd)
            os.unlink(path)
        return outcome, "", {"mib": round(written / (1 << 20), 2)}
    return go


def cpu_hogs():
    sys.stdout.flush()
    before = os.times()
    start = time.monotonic()
    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                pass
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    wall = time.monotonic() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return "measured", "", {"cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}


def guard_answers(text):
    def go():
        return str(agentworks_bridge.call("notify_user", {"text": text}, timeout_s=30).get("decision"))
    return go


attempt("fork bomb (up to 2000 children)", fork_bomb)
attempt("fork after the fork bomb", fork_after_bomb)
attempt("thread bomb (up to 2000 threads)", thread_bomb)
attempt("memory bomb in a child", memory_bomb)
attempt("parent alive after the memory bomb", lambda: "alive")
attempt("fill /dev/shm", fill("/dev/shm/fill.bin", SHM_MB))
attempt("two busy processes for 1 s", cpu_hogs)
attempt("the guard still answers after the bombs", guard_answers("after the bombs"))

# Last: SIGKILL to every process this uid can signal. The caller itself is spared
# by kill(-1); the executor is not, so the container ends right after this.
report("kill(-1, SIGKILL) sent", "sending")
os.kill(-1, signal.SIGKILL)
attempt("the guard answers after kill(-1)", guard_answers("after kill -1"))
sys.exit(0)
"""

SAFE: dict[str, set[str]] = {
    "fork bomb (up to 2000 children)": {"EAGAIN"},
    "fork after the fork bomb": {"forks again"},
    "thread bomb (up to 2000 threads)": {"RuntimeError"},
    "memory bomb in a child": {"SIGKILL"},
    "parent alive after the memory bomb": {"alive"},
    "fill /dev/shm": {"ENOSPC"},
    "two busy processes for 1 s": {"measured"},
    "the guard still answers after the bombs": {"stub"},
    "kill(-1, SIGKILL) sent": {"sending"},
}


@pytest.fixture(scope="module")
def battery(engine: DockerClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Battery]:
    if os.environ.get("SANDBOX_STEP_RUNTIME") == "runsc":
        pytest.skip(
            "under gVisor a fork past the pids limit or a memory bomb ends the whole sandbox "
            "(README: second walls); tests/engines/test_walls.py checks that run's record"
        )
    root = tmp_path_factory.mktemp("sec-res")
    script = (
        STEP.replace("@@PIDS@@", str(PIDS))
        .replace("@@TMPFS_MB@@", str(TMPFS_MB))
        .replace("@@SHM_MB@@", str(SHM_MB))
    )
    wf = build_workflow(
        root,
        script,
        earlier_files={"in.txt": "in"},
        extra_toml=(
            f"[limits]\nmemory_mb = {MEMORY_MB}\npids = {PIDS}\ntmpfs_mb = {TMPFS_MB}\ncpus = 1.0\n"
        ),
    )
    yield run_battery(engine, wf)


def test_run_ended_as_a_killed_step_with_the_guard_alive(battery: Battery) -> None:
    record = battery.record
    assert record.status is RunStatus.FAILED, f"{record.status}: {record.reason}"
    # kill(-1) kills every process the step can signal; pid 1 (the executor) survives,
    # reports the step's death, and the run ends as a failed step.
    assert record.exit_code not in (None, 0), record.exit_code
    assert "guard" not in record.reason, record.reason  # not "the guard stopped during the run"
    assert_left_no_trace(battery)


def test_every_reported_attempt_is_asserted(battery: Battery) -> None:
    # The container may be gone before the last attempt runs.
    assert_attempts_match(battery, SAFE, optional=frozenset({"the guard answers after kill(-1)"}))


@pytest.mark.parametrize("name", list(SAFE))
def test_attempt_is_contained(battery: Battery, name: str) -> None:
    check(battery, name, SAFE[name])


def test_fork_bomb_hit_the_pids_limit(battery: Battery) -> None:
    forks = battery.outcome("fork bomb (up to 2000 children)").data["forks"]
    threads = battery.outcome("thread bomb (up to 2000 threads)").data["threads"]
    assert 0 < forks < PIDS, f"{forks} children forked with pids={PIDS}"
    assert 0 < threads < PIDS, f"{threads} threads started with pids={PIDS}"


def test_memory_stayed_under_the_limit(battery: Battery) -> None:
    peak = battery.record.resources.peak_memory_bytes
    assert peak is None or peak <= MEMORY_MB * 1024**2, f"peak {peak} over {MEMORY_MB} MiB"


def test_shm_filled_below_its_cap(battery: Battery) -> None:
    # /tmp is a folder of the step's disk: filling it is a quota run
    # (tests/scenarios/test_host_side_engine.py writes past the quota through it).
    shm = battery.outcome("fill /dev/shm").data["mib"]
    assert 0 < shm <= SHM_MB, f"/dev/shm took {shm} MiB"


def test_cpu_quota_held(battery: Battery) -> None:
    data = battery.outcome("two busy processes for 1 s").data
    ratio = data["cpu_s"] / data["wall_s"]
    assert ratio < 1.5, f"two busy processes used {ratio:.2f} CPUs with cpus=1.0: {data}"


def test_guard_logged_every_call_it_answered(battery: Battery) -> None:
    lines = [ActionLine.model_validate_json(ln) for ln in battery.action_lines()]
    texts = [ln.arguments.get("text") for ln in lines]
    assert texts[:1] == ["after the bombs"], texts
    after_kill = battery.attempts.get("the guard answers after kill(-1)")
    if after_kill is not None:  # the step outlived its executor for a moment
        assert after_kill.outcome == "stub", after_kill
        assert texts == ["after the bombs", "after kill -1"], texts


def test_the_host_is_fine(engine: DockerClient, battery: Battery) -> None:
    assert engine.ping()
    done = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True)
    assert done.stdout.strip() == "ok"
