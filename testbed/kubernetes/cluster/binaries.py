"""The cluster's binaries: built once by scripts/kubernetes-build.sh and cached.

A build cut short (a timeout, Ctrl-C) is stopped whole (its process group), so
nothing of a half-done build keeps running after the session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from testbed.kubernetes.cluster.state import REPO_ROOT, ClusterError

__all__ = ["BUILD_SCRIPT", "ClusterError", "ensure_binaries"]

BUILD_SCRIPT = REPO_ROOT / "scripts" / "kubernetes-build.sh"
BUILD_STOP_GRACE_S = 5.0


def ensure_binaries(timeout_s: float | None = None) -> Path:
    """The cached build folder (`build/kubernetes/<version>/`), building it if missing.

    The build (minutes, many processes: apt-get, go) runs in its own process group and
    is waited for. Cut short (`timeout_s`, Ctrl-C, a test session's timeout), the whole
    group is stopped: nothing of a half-done build keeps running after the session,
    and the user is told to run the build on its own."""
    proc = subprocess.Popen(
        ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except BaseException as exc:
        _stop_group(proc)
        cause = "timed out" if isinstance(exc, subprocess.TimeoutExpired) else "was interrupted"
        raise ClusterError(
            f"building the cluster's binaries {cause} and was stopped; run "
            f"scripts/{BUILD_SCRIPT.name} on its own once (minutes; cached in build/kubernetes/)"
        ) from None
    if proc.returncode != 0:
        raise ClusterError(f"{BUILD_SCRIPT.name} failed (exit {proc.returncode})")
    return Path(out.strip().splitlines()[-1])


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the build's process group, SIGKILL to what is left after the grace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=BUILD_STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its children, should the leader have gone
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
