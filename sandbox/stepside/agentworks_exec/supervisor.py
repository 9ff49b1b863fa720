"""PID 1 of the step container: start-up checks, the step as a child, orphans reaped."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Final

from .executor import Executor
from .interface import GUARD_WAIT_ENV, USAGE_MARK
from .preflight import gate as preflight_gate
from .results import os_reason
from .server import ExecServer
from .shell import OWN_CHILDREN, SPAWN_LOCK, exit_status
from .walls import gate as landlock_gate

PORT_ENV: Final = "AGENTWORKS_EXEC_PORT"


TOKEN_ENV: Final = "AGENTWORKS_EXEC_TOKEN"


ROOT_ENV: Final = "AGENTWORKS_EXEC_ROOT"


GUARD_WAIT_S: Final = 60.0


GUARD_DOWN_EXIT: Final = 125


PR_SET_DUMPABLE: Final = 4


FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _no_dump() -> None:
    """Best effort: same-uid processes may not read our memory or /proc/<pid>/environ."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _scrub_initial_environ(names: Sequence[str]) -> None:
    """Overwrite `NAME=value` of each of `names` with NUL bytes where the kernel keeps
    the process's initial environment, which `/proc/<pid>/environ` shows; call it
    before the variables are popped (unsetenv drops the pointer, not the bytes).

    Non-dumpable already closes that file to same-uid processes under runc; gVisor's
    sentry does not enforce that, so there the bytes themselves must go."""
    with contextlib.suppress(Exception):
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
        prefixes = [name.encode() + b"=" for name in names]
        index = 0
        while environ[index]:
            address = environ[index]
            entry = ctypes.string_at(address)
            if any(entry.startswith(prefix) for prefix in prefixes):
                ctypes.memset(address, 0, len(entry))
            index += 1


def _usage(message: str) -> int:
    print(f"agentworks_exec: {message}", file=sys.stderr)
    print("usage: python3 -m agentworks_exec -- <command> [args...]", file=sys.stderr)
    return 2


def _launch_error(cmd: Sequence[str], exc: OSError) -> int:
    print(f"agentworks_exec: cannot run {cmd[0]!r}: {os_reason(exc)}", file=sys.stderr)
    return 127 if isinstance(exc, FileNotFoundError) else 126


def _wait_for_guard(address: str, deadline_s: float = GUARD_WAIT_S) -> bool:
    """True once something listens at `address` (the guard binds only when it is ready).

    The runner starts the step as soon as the firewall is in, while the guard is
    still importing; the step's first bridge call must not find nobody home."""
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        return False
    end = time.monotonic() + deadline_s
    pause = 0.002
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= end:
                return False
            time.sleep(pause)  # a refused connect returns at once: back off a little
            pause = min(pause * 2, 0.01)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the step command under the executor; returns the step's exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    cmd = args[1:] if args[:1] == ["--"] else args
    if not cmd:
        return _usage("no step command given")
    _scrub_initial_environ([TOKEN_ENV])
    port_text = os.environ.pop(PORT_ENV, "").strip()
    token = os.environ.pop(TOKEN_ENV, "")
    _no_dump()
    refused = preflight_gate()  # the ways out must be closed before the step starts
    if refused is not None:
        return refused
    root = os.environ.get(ROOT_ENV) or os.getcwd()
    # Still one thread: the wall binds this one and everything it starts.
    refused = landlock_gate(root)
    if refused is not None:
        return refused
    guard = os.environ.pop(GUARD_WAIT_ENV, "")
    if guard and not _wait_for_guard(guard):
        print(
            f"agentworks_exec: the run's guard did not answer at {guard} within"
            f" {GUARD_WAIT_S:.0f} s; the step was not started",
            file=sys.stderr,
        )
        return GUARD_DOWN_EXIT
    if not port_text:
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            return _launch_error(cmd, exc)
    try:
        port = int(port_text)
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        return _usage(f"{PORT_ENV} must be a TCP port number, not {port_text!r}")
    if not token:
        return _usage(f"{PORT_ENV} is set but {TOKEN_ENV} is empty; refusing to serve")
    executor = Executor(root)
    try:
        server = ExecServer(port, token, executor)
    except OSError as exc:
        print(f"agentworks_exec: cannot listen on 127.0.0.1:{port}: {exc}", file=sys.stderr)
        return 2
    del token
    threading.Thread(target=server.serve_forever, name="agentworks-exec", daemon=True).start()
    return _run_step(cmd)


def _run_step(cmd: list[str]) -> int:
    """Run the step as a child, forwarding termination signals; its exit code."""
    child: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if not child:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            child[0].send_signal(signum)

    for signum in FORWARDED_SIGNALS:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, forward)
    try:
        child.append(subprocess.Popen(cmd))
    except OSError as exc:
        return _launch_error(cmd, exc)
    for early in pending:
        with contextlib.suppress(ProcessLookupError):
            child[0].send_signal(early)
    reap_until_exit(child[0].pid)
    code = exit_status(child[0].wait())
    _report_usage()
    return code


# The container's own memory high-water mark (page cache and tmpfs included), as the
# kernel keeps it: cgroup v2, then v1 (the container has its own cgroup namespace).
CGROUP_PEAK_FILES: Final = (
    "/sys/fs/cgroup/memory.peak",
    "/sys/fs/cgroup/memory/memory.max_usage_in_bytes",
)


def _cgroup_memory_peak() -> int | None:
    for path in CGROUP_PEAK_FILES:
        try:
            with open(path, encoding="ascii") as handle:
                return int(handle.read().strip())
        except (OSError, ValueError):
            continue
    return None


def _report_usage() -> None:
    """The step's CPU time and largest RSS (rusage of every reaped descendant), on stderr.

    Engine stats are sampled and can miss a short step entirely; this cannot."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    report: dict[str, float | int] = {
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 6),
        "max_rss_bytes": int(usage.ru_maxrss) * 1024,
    }
    peak = _cgroup_memory_peak()
    if peak is not None:
        report["cgroup_peak_bytes"] = peak
    with contextlib.suppress(OSError):
        os.write(2, f"{USAGE_MARK} {json.dumps(report)}\n".encode())


def reap_until_exit(step_pid: int) -> None:
    """Wait for the step, reaping orphans on the way.

    The executor runs as the container's pid 1 (no docker-init: an init process would
    keep the whole container environment, executor token included, readable by the
    step in /proc/1/environ), so orphaned grandchildren are re-parented to it. Peek
    with WNOWAIT, reap strangers, and leave the step and tool children to their own
    `wait()`."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            return
        except InterruptedError:
            continue
        if info is None:
            continue
        if info.si_pid == step_pid:
            return
        with SPAWN_LOCK:
            ours = info.si_pid in OWN_CHILDREN
            if not ours:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(info.si_pid, 0)
        if ours:
            time.sleep(0.01)  # its tool thread is about to reap it
