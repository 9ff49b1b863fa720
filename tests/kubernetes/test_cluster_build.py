"""The cluster fixture's cold build, cut short: the whole build stops, the user is told.

A fake build script that never ends stands in for scripts/kubernetes-build.sh (no
real build): it starts a child of its own, as apt-get and go do, and records both
pids. Once the wait is cut short, neither may still run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from testbed.kubernetes import cluster
from testbed.kubernetes.cluster import binaries
from tests.polling import wait_for

DEADLINE_S = 30.0


def _fake_build(tmp_path: Path) -> tuple[Path, Path]:
    pids = tmp_path / "pids"
    script = tmp_path / "kubernetes-build.sh"
    script.write_text(
        textwrap.dedent(
            f"""\
            sleep 600 &
            echo "$$ $!" > {pids}.part && mv {pids}.part {pids}
            wait
            """
        )
    )
    return script, pids


def _build_pids(pids: Path) -> list[int]:
    wait_for(pids.exists, DEADLINE_S, "the fake build to start")
    return [int(p) for p in pids.read_text().split()]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_all_stopped(pids: list[int]) -> None:
    wait_for(lambda: not any(_running(p) for p in pids), DEADLINE_S, "the build's processes")


def test_a_build_past_its_timeout_is_stopped_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script, pids = _fake_build(tmp_path)
    monkeypatch.setattr(binaries, "BUILD_SCRIPT", script)
    with pytest.raises(cluster.ClusterError, match=r"run scripts/kubernetes-build\.sh"):
        binaries.ensure_binaries(timeout_s=5.0)  # the fake writes its pids at once
    _assert_all_stopped(_build_pids(pids))


# Ctrl-C as a terminal gives it: a runner started in the background by a shell without
# job control (as some CI jobs start their commands) inherits SIGINT ignored, and
# Python then installs no KeyboardInterrupt for it.
RUNNER = """
import signal
import sys
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)
from testbed.kubernetes.cluster import binaries
binaries.BUILD_SCRIPT = Path(sys.argv[1])
try:
    binaries.ensure_binaries()
except binaries.ClusterError as exc:
    print(exc)
    sys.exit(3)
"""


def test_an_interrupted_build_is_stopped_whole(tmp_path: Path) -> None:
    """Ctrl-C during the cold build (a session that waits minutes and is given up)."""
    script, pids = _fake_build(tmp_path)
    repo = Path(cluster.REPO_ROOT)
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(script)],
        cwd=repo,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    try:
        build = _build_pids(pids)
        runner.send_signal(signal.SIGINT)
        out, _ = runner.communicate(timeout=DEADLINE_S)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    assert runner.returncode == 3, out
    assert "was interrupted" in out and "run scripts/kubernetes-build.sh" in out
    _assert_all_stopped(build)
