"""A live runner stays alive to `sandbox gc` and the lock whatever the wall clock does.

Linux computes `btime` from the wall clock at every read, so a clock step (NTP, a
resumed VM) moves every process's wall-clock start time; a gc that compared only that
would take a live run's containers for an orphan's and remove them. The runner also
records its start in clock ticks since boot and the boot's id, and those are compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sandbox.backends.docker.gc import orphaned, record_runner_alive, runner_alive
from sandbox.contracts import names
from sandbox.hostfs import procstart
from sandbox.launch import specs
from sandbox.prepare import lock
from sandbox.run.testrun import runner_info
from tests.launch.specparts import plan
from tests.polling import wait_for

STEP_S = 3600.0  # the clock stepped by an hour since the runner recorded its start


def test_the_runners_record_names_it_in_ticks_and_boot() -> None:
    info = runner_info()
    assert info.pid == os.getpid()
    assert info.start_ticks == procstart.process_start_ticks(os.getpid())
    assert info.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert procstart.same_process(info.pid, info.start_ticks, info.boot_id)


def test_a_live_runner_is_alive_after_a_clock_step() -> None:
    me = runner_info()
    assert me.start_ticks is not None and me.boot_id is not None
    stepped = me.create_time - STEP_S  # what it recorded, as seen after the step
    assert runner_alive(me.pid, stepped, me.start_ticks, me.boot_id)
    assert record_runner_alive(me.model_copy(update={"create_time": stepped}))
    # A record from before the ticks were kept has only the wall clock to go by.
    assert not runner_alive(me.pid, stepped)
    assert runner_alive(me.pid, me.create_time)


def test_another_start_or_another_boot_is_not_the_runner() -> None:
    me = runner_info()
    assert me.start_ticks is not None and me.boot_id is not None
    assert not runner_alive(me.pid, me.create_time, me.start_ticks + 1, me.boot_id)
    other_boot = "0" * 8 + me.boot_id[8:]
    assert other_boot != me.boot_id
    assert not runner_alive(me.pid, me.create_time, me.start_ticks, other_boot)
    assert not record_runner_alive(None)


def _labels(pid: int, start: float, ticks: str | None, boot: str | None) -> dict[str, str]:
    labels = {names.LABEL_RUNNER_PID: str(pid), names.LABEL_RUNNER_START: repr(start)}
    if ticks is not None:
        labels[names.LABEL_RUNNER_TICKS] = ticks
    if boot is not None:
        labels[names.LABEL_RUNNER_BOOT] = boot
    return labels


def test_gc_reads_a_live_runners_labels_as_live_after_a_clock_step(tmp_path: Path) -> None:
    me = runner_info()
    labels = specs.labels(plan(tmp_path, runner=me), "guard")
    assert labels[names.LABEL_RUNNER_TICKS] == str(me.start_ticks)
    assert labels[names.LABEL_RUNNER_BOOT] == me.boot_id
    assert not orphaned(labels)
    stepped = {**labels, names.LABEL_RUNNER_START: repr(me.create_time - STEP_S)}
    assert not orphaned(stepped)
    assert orphaned({**stepped, names.LABEL_RUNNER_TICKS: str(int(me.start_ticks or 0) + 1)})
    assert orphaned({**stepped, names.LABEL_RUNNER_TICKS: "not-a-number"})
    # Labels from before the ticks: the wall-clock start, as before.
    assert not orphaned(_labels(me.pid, me.create_time, None, None))
    assert orphaned(_labels(me.pid, me.create_time - STEP_S, None, None))


def test_a_gone_or_zombie_runner_is_dead() -> None:
    boot = procstart.boot_id()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        ticks = procstart.process_start_ticks(child.pid)
        assert procstart.same_process(child.pid, ticks, boot)
        assert child.stdin is not None
        child.stdin.close()
        # Exited but not reaped: a zombie holds its pid and start, and is no runner.
        wait_for(
            lambda: (
                Path(f"/proc/{child.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"Z"
            ),
            30,
            "the child to be a zombie",
        )
        assert not procstart.same_process(child.pid, ticks, boot)
        labels = _labels(child.pid, procstart.process_start(child.pid), str(ticks), boot)
        assert orphaned(labels)
    finally:
        child.wait(timeout=60)
    assert not procstart.same_process(child.pid, ticks, boot)
    assert orphaned(labels)


def test_the_locks_sidecar_of_a_live_holder_survives_a_clock_step() -> None:
    me = runner_info()
    sidecar = {
        "pid": me.pid,
        "process_start": me.create_time - STEP_S,
        "start_ticks": me.start_ticks,
        "boot_id": me.boot_id,
    }
    assert lock._alive(sidecar)
    assert not lock._alive({**sidecar, "start_ticks": int(me.start_ticks or 0) + 1})
    # A sidecar from before the ticks: the wall-clock start within a second.
    assert lock._alive({"pid": me.pid, "process_start": me.create_time})
    assert not lock._alive({"pid": me.pid, "process_start": me.create_time - STEP_S})


def test_a_new_sidecar_names_its_holder_in_ticks_and_boot(tmp_path: Path) -> None:
    me = runner_info()
    with lock.workflow_run_lock(tmp_path, exclusive=True, owner="test"):
        (sidecar,) = (lock.lock_home(tmp_path) / lock.INFO_DIR_NAME).glob("*.json")
        data = json.loads(sidecar.read_text())
    assert (data["start_ticks"], data["boot_id"]) == (me.start_ticks, me.boot_id)
    assert lock._alive(data)
