"""Per-workflow run exclusivity: normal runs share the lock, a test run holds it alone.

Guarantees: the lock is a non-blocking ``flock`` on ``.sandbox.lock`` in the workflow's lock
home, outside the workflow folder (opened ``O_NOFOLLOW``; a symlink is refused), that the kernel
drops when its holder dies, and a refusal names the holders (pid, command, start time, mode,
owner) from ``/proc/locks`` and the sidecars in ``.sandbox.lock.d/``. Not guaranteed: exclusion
against programs that ignore this lock, file systems without ``flock``, and full holder details
without ``/proc/locks``. The protocol, for a program in any language: ``lock.spec.md``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shlex
import stat
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Final

from pydantic import BaseModel, ConfigDict

from sandbox.contracts.errors import ConfigError, RefusedError
from sandbox.contracts.settings import runner_settings
from sandbox.hostfs.procstart import process_start, same_process, start_identity

__all__ = [
    "INFO_DIR_NAME",
    "LOCK_FILE_NAME",
    "LockError",
    "LockHeldError",
    "LockHolder",
    "WorkflowLock",
    "holders",
    "workflow_run_lock",
]

# Notes. The lock belongs to the open file description: a fork() without exec shares it (the fd
# is O_CLOEXEC, so exec does not). Sidecars are named <pid>-<token>.json (not <pid>.json) so one
# process may hold several shared locks; a sidecar whose process is gone (or whose pid was
# reused, checked by process start time) is stale, ignored, and removed by the next holder.

LOCK_FILE_NAME: Final = ".sandbox.lock"
INFO_DIR_NAME: Final = ".sandbox.lock.d"
PROC_LOCKS: Final = "/proc/locks"

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_SIDECAR_RE: Final = re.compile(r"^(\d+)(?:-([0-9a-f]+))?\.json$")
_SIDECAR_MAX: Final = 64 * 1024


class LockError(ConfigError):
    """The lock file or its sidecar folder is unusable (e.g. a symlink was planted there)."""


class LockHolder(BaseModel):
    """One holder of a workflow's run lock."""

    # Built at its first use (a refused lock), not by every run that imports this.
    model_config = ConfigDict(defer_build=True)

    pid: int | None
    command: str
    since: datetime | None  # when the holding process started
    exclusive: bool
    owner: str | None = None
    locked_at: datetime | None = None  # from the holder's sidecar


class LockHeldError(RefusedError):
    """The lock is taken in a conflicting mode; the message names who holds it."""

    def __init__(self, workflow_dir: Path, exclusive: bool, found: list[LockHolder]) -> None:
        self.workflow_dir = workflow_dir
        self.exclusive = exclusive
        self.holders = found
        want = "a test run (exclusive)" if exclusive else "a run (shared)"
        if found:
            who = "; ".join(_describe(h) for h in found)
        else:
            who = "a process that could not be identified (it may have just released it)"
        super().__init__(
            f"workflow {workflow_dir} is busy: cannot start {want}; lock held by {who}."
            " Wait for it to finish, then retry."
        )


def _describe(h: LockHolder) -> str:
    mode = "exclusive, test run" if h.exclusive else "shared"
    owner = f", owner {h.owner!r}" if h.owner else ""
    since = f", running since {h.since.isoformat(timespec='seconds')}" if h.since else ""
    pid = f"pid {h.pid}" if h.pid else "pid unknown"
    return f"{pid} ({mode}{owner}{since}): {h.command}"


class WorkflowLock:
    """A held run lock. Use as a context manager; :meth:`release` is idempotent."""

    def __init__(
        self,
        workflow_dir: Path,
        fd: int,
        exclusive: bool,
        owner: str,
        sidecar: str | None,
        home: Path,
    ) -> None:
        self.workflow_dir = workflow_dir
        self._home = home
        self.exclusive = exclusive
        self.owner = owner
        self._fd: int | None = fd
        self._sidecar = sidecar

    @property
    def held(self) -> bool:
        return self._fd is not None

    def fileno(self) -> int:
        """The locked descriptor, for a child that must hold the lock as long as it runs
        (`sandbox lock`): the lock lasts while any process has it open."""
        if self._fd is None:
            raise ValueError("the lock was released")
        return self._fd

    def release(self) -> None:
        """Remove this holder's sidecar, then drop the lock. Safe to call more than once."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._sidecar is not None:
                with contextlib.suppress(OSError):
                    info_fd = _open_info_dir(self._home, create=False)
                    try:
                        os.unlink(self._sidecar, dir_fd=info_fd)
                    finally:
                        os.close(info_fd)
        finally:
            os.close(fd)  # closing the only fd of this open file description unlocks

    def __enter__(self) -> WorkflowLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()

    def __repr__(self) -> str:
        mode = "exclusive" if self.exclusive else "shared"
        state = "held" if self.held else "released"
        return f"<WorkflowLock {self.workflow_dir} {mode} {state} owner={self.owner!r}>"


def lock_home(workflow_dir: Path) -> Path:
    """The folder holding one workflow's lock file and sidecars, outside the workflow.

    The real workflow folder must stay byte-identical across a test run, so the lock
    lives in the host's lock directory (``$SANDBOX_LOCK_DIR``, else ``/run/lock/sandbox``,
    else a per-user folder in the temp dir), keyed by the workflow folder's device and
    inode so two spellings of one path share one lock.
    """
    st = os.stat(workflow_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise LockError(f"{workflow_dir} is not a directory")
    base = runner_settings().lock_dir
    candidates = [base] if base else [Path("/run/lock/sandbox"), _user_lock_base()]
    for root in candidates:
        try:
            root.mkdir(mode=0o755, parents=True, exist_ok=True)
            rst = os.stat(root, follow_symlinks=False)
            if not stat.S_ISDIR(rst.st_mode) or rst.st_uid != os.geteuid():
                continue
            home = root / f"{st.st_dev}-{st.st_ino}"
            with contextlib.suppress(FileExistsError):
                os.mkdir(home, 0o755)
            if os.path.islink(home) or not os.access(home, os.W_OK):
                continue
            return home
        except OSError:
            continue
    raise LockError(f"no usable lock directory for {workflow_dir} (set SANDBOX_LOCK_DIR)")


def _user_lock_base() -> Path:
    return Path(tempfile.gettempdir()) / f"sandbox-locks-{os.geteuid()}"


def _open_lock_file(workflow_dir: Path) -> int:
    wfd = os.open(workflow_dir, _DIR_FLAGS)
    try:
        try:
            fd = os.open(
                LOCK_FILE_NAME,
                os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                0o644,
                dir_fd=wfd,
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LockError(
                    f"{workflow_dir / LOCK_FILE_NAME} is a symlink; refusing to use it"
                ) from exc
            raise LockError(f"cannot open {workflow_dir / LOCK_FILE_NAME}: {exc.strerror}") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise LockError(f"{workflow_dir / LOCK_FILE_NAME} is not a regular file")
        return fd
    finally:
        os.close(wfd)


def _open_info_dir(workflow_dir: Path, *, create: bool) -> int:
    wfd = os.open(workflow_dir, _DIR_FLAGS)
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(INFO_DIR_NAME, 0o755, dir_fd=wfd)
        try:
            return os.open(INFO_DIR_NAME, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=wfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise LockError(
                    f"{workflow_dir / INFO_DIR_NAME} is a symlink or not a directory;"
                    " refusing to use it"
                ) from exc
            raise
    finally:
        os.close(wfd)


def _same_file(fd: int, workflow_dir: Path) -> bool:
    """True if ``fd`` is still the file named ``.sandbox.lock`` (it was not replaced)."""
    try:
        now = os.stat(workflow_dir / LOCK_FILE_NAME, follow_symlinks=False)
    except OSError:
        return False
    st = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _proc_start(pid: int) -> float | None:
    try:
        return process_start(pid)
    except (OSError, ValueError):
        return None


def _proc_identity(pid: int) -> dict[str, Any]:
    """The process's start in clock ticks and its boot, which `_alive` prefers to the
    wall-clock start (a clock step moves that one); empty when unreadable."""
    identity = start_identity(pid)
    return {} if identity is None else {"start_ticks": identity[0], "boot_id": identity[1]}


def workflow_run_lock(
    workflow_dir: Path, *, exclusive: bool = False, owner: str = ""
) -> WorkflowLock:
    """Take the workflow's run lock now, or raise :class:`LockHeldError` naming the holders.

    ``exclusive=True`` for a test run (nothing else may run), False for a normal run (shares
    with other normal runs). The result is a context manager:
    ``with workflow_run_lock(wf, owner="controller run 17"): ...``.
    """
    workflow_dir = Path(workflow_dir)
    home = lock_home(workflow_dir)
    for _attempt in range(5):
        fd = _open_lock_file(home)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise LockHeldError(workflow_dir, exclusive, _holders(home)) from None
            raise LockError(f"cannot lock {home / LOCK_FILE_NAME}: {exc}") from exc
        if _same_file(fd, home):
            break
        os.close(fd)  # the file was replaced under us: lock the new one
    else:
        raise LockError(f"{home / LOCK_FILE_NAME} keeps being replaced; giving up")
    try:
        sidecar = _write_sidecar(home, exclusive, owner)
    except BaseException:
        os.close(fd)
        raise
    return WorkflowLock(workflow_dir, fd, exclusive, owner, sidecar, home)


def _write_sidecar(workflow_dir: Path, exclusive: bool, owner: str) -> str:
    pid = os.getpid()
    info_fd = _open_info_dir(workflow_dir, create=True)
    try:
        _remove_stale(info_fd)
        name = f"{pid}-{secrets.token_hex(6)}.json"
        data = {
            "pid": pid,
            "owner": owner,
            "exclusive": exclusive,
            "locked_at": datetime.now(UTC).isoformat(),
            "process_start": _proc_start(pid),
            **_proc_identity(pid),
        }
        tmp = f".{name}.tmp"
        wfd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=info_fd,
        )
        try:
            os.write(wfd, json.dumps(data).encode())
        finally:
            os.close(wfd)
        os.rename(tmp, name, src_dir_fd=info_fd, dst_dir_fd=info_fd)
        return name
    finally:
        os.close(info_fd)


def _read_sidecars(info_fd: int) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    with os.scandir(info_fd) as it:
        names = sorted(e.name for e in it)
    for name in names:
        m = _SIDECAR_RE.match(name)
        if not m:
            continue
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=info_fd
            )
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            raw = os.read(fd, _SIDECAR_MAX)
        finally:
            os.close(fd)
        try:
            data = json.loads(raw)
        except ValueError:
            continue
        if isinstance(data, dict):
            data["pid"] = int(m.group(1))
            out.append((name, data))
    return out


def _alive(data: dict[str, Any]) -> bool:
    """The sidecar's process still runs (same pid and same start time)."""
    ticks, boot = data.get("start_ticks"), data.get("boot_id")
    if isinstance(ticks, int) and not isinstance(ticks, bool) and isinstance(boot, str) and boot:
        return same_process(int(data["pid"]), ticks, boot)
    start = _proc_start(int(data["pid"]))
    recorded = data.get("process_start")
    if start is None:
        return False
    return not isinstance(recorded, int | float) or abs(start - float(recorded)) < 1.0


def _remove_stale(info_fd: int) -> None:
    for name, data in _read_sidecars(info_fd):
        if not _alive(data):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=info_fd)


def _lock_lines(st: os.stat_result) -> list[tuple[int, bool, bool]]:
    """(pid, exclusive, device_matches) per FLOCK on this inode in /proc/locks."""
    with open(PROC_LOCKS, encoding="ascii", errors="replace") as f:
        text = f.read()
    dev = (os.major(st.st_dev), os.minor(st.st_dev))
    found: list[tuple[int, bool, bool]] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6 or "->" in parts or parts[1] != "FLOCK":
            continue
        try:
            pid = int(parts[4])
            maj, mnr, ino = parts[5].split(":")
            if int(ino) != st.st_ino:
                continue
            same_dev = (int(maj, 16), int(mnr, 16)) == dev
        except ValueError:
            continue
        found.append((pid, parts[3] == "WRITE", same_dev))
    return found


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def holders(workflow_dir: Path) -> list[LockHolder]:
    """Who holds the workflow's run lock now (empty if nobody or no lock file)."""
    return _holders(lock_home(Path(workflow_dir)))


def _holders(workflow_dir: Path) -> list[LockHolder]:
    try:
        st = os.stat(workflow_dir / LOCK_FILE_NAME, follow_symlinks=False)
    except OSError:
        return []
    if not stat.S_ISREG(st.st_mode):
        return []
    sidecars: dict[int, list[dict[str, Any]]] = {}
    try:
        info_fd = _open_info_dir(workflow_dir, create=False)
    except (OSError, LockError):
        info_fd = None
    if info_fd is not None:
        try:
            for _, data in _read_sidecars(info_fd):
                if _alive(data):
                    sidecars.setdefault(int(data["pid"]), []).append(data)
        finally:
            os.close(info_fd)
    for entries in sidecars.values():
        entries.sort(key=lambda d: str(d.get("locked_at", "")))
    try:
        lines = _lock_lines(st)
    except OSError:
        lines = [(pid, bool(d.get("exclusive")), True) for pid, ds in sidecars.items() for d in ds]
    # Inode-only matches (overlay file systems report another device) count when a live
    # sidecar of that pid vouches for them.
    lines = [ln for ln in lines if ln[2] or ln[0] in sidecars]
    result: list[LockHolder] = []
    for pid, exclusive, _ in lines:
        info = sidecars.get(pid, [])
        match = next((d for d in info if bool(d.get("exclusive")) == exclusive), None)
        if match is not None:
            info.remove(match)
        result.append(_holder(pid, exclusive, match))
    return result


def _holder(pid: int, exclusive: bool, info: dict[str, Any] | None) -> LockHolder:
    import psutil  # only to name a holder when the lock is refused: a run never loads it

    command = "(not visible from here)"
    since: datetime | None = None
    if pid > 0:
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                cmdline = proc.cmdline()
                since = datetime.fromtimestamp(proc.create_time(), UTC)
            command = shlex.join(cmdline) if cmdline else f"[{proc.name()}]"
        except psutil.NoSuchProcess:
            command = "(exited)"
        except (psutil.Error, OSError):
            command = "(access denied)"
    owner = info.get("owner") if info else None
    return LockHolder(
        pid=pid if pid > 0 else None,
        command=command,
        since=since,
        exclusive=exclusive,
        owner=str(owner) if owner else None,
        locked_at=_parse_time(info.get("locked_at")) if info else None,
    )
