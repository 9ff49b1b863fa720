"""PID 1 of the step container: start-up checks, the step as a child, orphans reaped.

The start-up path (everything before the step command runs) loads only what it uses:
the interpreter's own modules, `socket`, `ctypes` and the checks. The HTTP server, the
tools and what they import (`http.server`, `sqlite3`, `subprocess`...) load in the
server's thread when the guard first connects, after the step started: its listening
socket is bound before the step starts (the guard's first call finds it and waits in
its backlog), and a step that makes no tool call never loads them. In the step image
that keeps about 60 ms of imports out of every run's start.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time

from .children import OWN_CHILDREN, SPAWN_LOCK, exit_status
from .interface import GUARD_WAIT_ENV, USAGE_MARK
from .preflight import begin as preflight_begin
from .preflight import finish as preflight_finish
from .results import os_reason
from .walls import gate as landlock_gate

# Not `typing.TYPE_CHECKING`: `typing` alone costs the start-up ~10 ms in the step image.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import FrameType
    from typing import Final

PORT_ENV: Final = "AGENTWORKS_EXEC_PORT"


TOKEN_ENV: Final = "AGENTWORKS_EXEC_TOKEN"


ROOT_ENV: Final = "AGENTWORKS_EXEC_ROOT"


GUARD_WAIT_S: Final = 60.0


GUARD_DOWN_EXIT: Final = 125


PR_SET_DUMPABLE: Final = 4


FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _no_dump() -> None:
    """Best effort: same-uid processes may not read our memory or /proc/<pid>/environ."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except Exception:
        pass


def _scrub_initial_environ(names: Sequence[str]) -> None:
    """Overwrite `NAME=value` of each of `names` with NUL bytes where the kernel keeps
    the process's initial environment, which `/proc/<pid>/environ` shows; call it
    before the variables are popped (unsetenv drops the pointer, not the bytes).

    Non-dumpable already closes that file to same-uid processes under runc; gVisor's
    sentry does not enforce that, so there the bytes themselves must go."""
    try:
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
        prefixes = [name.encode() + b"=" for name in names]
        index = 0
        while environ[index]:
            address = environ[index]
            entry = ctypes.string_at(address)
            if any(entry.startswith(prefix) for prefix in prefixes):
                ctypes.memset(address, 0, len(entry))
            index += 1
    except Exception:
        pass


def _usage(message: str) -> int:
    print(f"agentworks_exec: {message}", file=sys.stderr)
    print("usage: python3 -m agentworks_exec -- <command> [args...]", file=sys.stderr)
    return 2


def _launch_error(cmd: Sequence[str], exc: OSError) -> int:
    print(f"agentworks_exec: cannot run {cmd[0]!r}: {os_reason(exc)}", file=sys.stderr)
    return 127 if isinstance(exc, FileNotFoundError) else 126


def _wait_for_guard(address: str, deadline_s: float = GUARD_WAIT_S) -> bool:
    """True once something listens at `address` (the guard binds only when it is ready).

    The runner starts the step's container as soon as the guard's runs, while the
    firewall goes in and the guard starts: the guard binds only after its entry script
    put the rules in and read them back right, so the preflight and the step come
    after this, and the step's first bridge call never finds nobody home."""
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
    # The ways out must be closed before the step starts. What needs no firewall is
    # checked first, while the guard may still be starting; then the guard: it
    # listens only once the firewall is in and read back right (the runner starts
    # this container while the rules still go in); then what the firewall closes.
    preflight = preflight_begin()
    guard = os.environ.pop(GUARD_WAIT_ENV, "")
    if guard and not _wait_for_guard(guard):
        print(
            f"agentworks_exec: the run's guard did not answer at {guard} within"
            f" {GUARD_WAIT_S:.0f} s; the step was not started",
            file=sys.stderr,
        )
        return GUARD_DOWN_EXIT
    refused = preflight_finish(preflight)
    if refused is not None:
        return refused
    root = os.environ.get(ROOT_ENV) or os.getcwd()
    # Still one thread: the wall binds this one and everything it starts.
    refused = landlock_gate(root)
    if refused is not None:
        return refused
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
    try:
        listener = listen(port)
    except OSError as exc:
        print(f"agentworks_exec: cannot listen on 127.0.0.1:{port}: {exc}", file=sys.stderr)
        return 2
    # The tools' root, resolved now: the step may change the folders under it later.
    threading.Thread(
        target=_serve_when_called,
        args=(listener, token, os.path.realpath(root)),
        name="agentworks-exec",
        daemon=True,
    ).start()
    del token
    return _run_step(cmd)


LISTEN_BACKLOG: Final = 5  # socketserver.TCPServer.request_queue_size


def listen(port: int) -> socket.socket:
    """The executor's socket on 127.0.0.1:`port`, made as `ThreadingHTTPServer` makes
    its own (address reuse, the same backlog), bound before the step starts."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _serve_when_called(listener: socket.socket, token: str, root: str) -> None:
    """The server's thread: at the first connection, load the server and the tools and
    serve for good. (`threading` itself is loaded on the main thread: imported first
    from another thread, it would take that one for the main thread and the exit
    would wait for it.)

    If the wait itself fails (a seccomp profile that refuses it, as runsc once did),
    the listener is closed and the reason goes to stderr: the guard's calls are then
    refused at once, each its own error, instead of waiting in the backlog for the
    step's timeout."""
    import select

    try:
        select.select([listener], [], [])
    except (OSError, ValueError) as exc:
        listener.close()
        try:
            os.write(2, f"agentworks_exec: cannot wait for tool calls: {exc}\n".encode())
        except OSError:
            pass
        return
    from .executor import Executor
    from .server import ExecServer

    ExecServer(listener, token, Executor(root, resolved=True)).serve_forever()


# Python ignores these; `subprocess.Popen` sets them back to default for a child.
RESTORED_SIGNALS: Final = (signal.SIGPIPE, signal.SIGXFSZ)


def _spawn(cmd: list[str]) -> int:
    """Start the step as `subprocess.Popen(cmd)` would, without loading subprocess: the
    signals Python ignores set back to default, and no descriptor but 0-2 inherited
    (Python's own are close-on-exec; any other is closed in the child). Raises
    OSError when it cannot run (FileNotFoundError: not found)."""
    closing = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        names = []
    for name in names:
        fd = int(name)
        if fd <= 2:
            continue
        try:
            if os.get_inheritable(fd):
                closing.append((os.POSIX_SPAWN_CLOSE, fd))
        except OSError:
            continue  # the listing's own descriptor, closed by now
    return os.posix_spawnp(
        cmd[0], cmd, os.environ, file_actions=closing, setsigdef=RESTORED_SIGNALS
    )


def _run_step(cmd: list[str]) -> int:
    """Run the step as a child, forwarding termination signals; its exit code."""
    child: list[int] = []
    pending: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if not child:
            pending.append(signum)
            return
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        try:
            signal.signal(signum, forward)
        except (OSError, ValueError):
            pass
    try:
        child.append(_spawn(cmd))
    except OSError as exc:
        return _launch_error(cmd, exc)
    for early in pending:
        try:
            os.kill(child[0], early)
        except ProcessLookupError:
            pass
    reap_until_exit(child[0])
    code = exit_status(_wait_exit(child[0]))
    _report_usage()
    return code


def _wait_exit(pid: int) -> int:
    """The child's end as `Popen.wait()` reports it: its exit code, or minus its signal."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return 0  # already reaped: nothing left to say (Popen says 0 too)
    return os.waitstatus_to_exitcode(status)


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
    import json
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    report: dict[str, float | int] = {
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 6),
        "max_rss_bytes": int(usage.ru_maxrss) * 1024,
    }
    peak = _cgroup_memory_peak()
    if peak is not None:
        report["cgroup_peak_bytes"] = peak
    try:
        os.write(2, f"{USAGE_MARK} {json.dumps(report)}\n".encode())
    except OSError:
        pass


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
                try:
                    os.waitpid(info.si_pid, 0)
                except ChildProcessError:
                    pass
        if ours:
            time.sleep(0.01)  # its tool thread is about to reap it
