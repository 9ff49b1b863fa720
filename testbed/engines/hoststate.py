"""What a second engine leaves on the host, read and undone by identity, never by name.

Mounts (from mountinfo, with their ids and propagation), cgroup trees (frozen, then
killed, then removed), and processes (a pid counts as ours only with the start time we
recorded, so a reused pid is never signalled). Host-wide reads only; the one write to
the host's mount table is the shared self-bind of a folder the caller names
(`bind_shared`), undone by `unmount_exact`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil
from pydantic import BaseModel

MS_BIND, MS_SHARED = 4096, 1 << 20
MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class Proc(BaseModel):
    """A process named by pid and start time (psutil's create_time)."""

    pid: int
    started: float

    @classmethod
    def of(cls, pid: int) -> Proc:
        return cls(pid=pid, started=psutil.Process(pid).create_time())

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return proc.create_time() == self.started and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


class Mount(BaseModel):
    id: int
    point: str
    fstype: str
    shared: bool


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as three octal digits."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts(pid: int | str = "self") -> list[Mount]:
    """The mounts of a process's mount namespace (the caller's by default), in order."""
    out = []
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            out.append(
                Mount(
                    id=int(fields[0]),
                    point=_unescape(fields[4]),
                    fstype=fields[sep + 1],
                    shared=any(tag.startswith("shared:") for tag in fields[6:sep]),
                )
            )
    return out


def within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def mounts_under(path: Path, pid: int | str = "self") -> list[Mount]:
    return [m for m in mounts(pid) if within(m.point, str(path))]


def top_mount(path: Path) -> Mount | None:
    """The mount on top at exactly `path` in the caller's namespace, if any."""
    found = [m for m in mounts() if m.point == str(path)]
    return found[-1] if found else None


def _syscall(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def bind_shared(path: Path) -> int:
    """Bind `path` onto itself and make that mount shared; returns its mount id.

    A namespace made later as a slave then receives every mount made below `path`
    on the host (the host's own mounts here are private: nothing propagates by
    default), and their unmounts too."""
    target = str(path).encode()
    _syscall(_libc.mount(target, target, None, MS_BIND, None), f"bind {path}")
    _syscall(_libc.mount(None, target, None, MS_SHARED, None), f"make-shared {path}")
    mount = top_mount(path)
    assert mount is not None and mount.shared
    return mount.id


def unmount_exact(path: Path, mount_id: int) -> str | None:
    """Unmount the mount `mount_id` at `path` if it is the one on top; an error or None."""
    mount = top_mount(path)
    if mount is None or mount.id != mount_id:
        return None
    if _libc.umount2(str(path).encode(), 0) == 0:
        return None
    err = ctypes.get_errno()
    below = mounts_under(path)[1:]
    if err == errno.EBUSY and not below:
        # An open file or a cwd in the folder (the folder itself, not the self-bind,
        # is what it uses): detach the self-bind; the files stay where they are.
        if _libc.umount2(str(path).encode(), MNT_DETACH) == 0:
            return None
        err = ctypes.get_errno()
    return f"{path}: {os.strerror(err)} (mounts below it: {below})"


def detach_all_under(path: Path) -> list[str]:
    """Lazily unmount every mount at or below `path` (deepest first); what was there."""
    found = [m.point for m in mounts_under(path)]
    for point in reversed(found):
        _libc.umount2(point.encode(), MNT_DETACH)
    return found


def ns_id(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def cgroup_hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, named ones, unified)."""
    return sorted({Path(m.point) for m in mounts() if m.fstype in ("cgroup", "cgroup2")})


def cgroup_dirs(parent: str) -> list[Path]:
    """The folders of cgroup `parent` ("/name") in every hierarchy that has it."""
    rel = parent.lstrip("/")
    return [h / rel for h in cgroup_hierarchies() if (h / rel).is_dir()]


def procs_in_cgroups(parent: str) -> set[int]:
    pids: set[int] = set()
    for root in cgroup_dirs(parent):
        for dirpath, _dirs, _files in os.walk(root):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in Path(dirpath, "cgroup.procs").read_text().split())
    return pids


def wait_for(what: str, check: Callable[[], bool], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() >= end:
            raise TimeoutError(f"{what}: not within {deadline_s:.0f} s")
        time.sleep(0.05)


def kill_cgroup_tree(parent: str, deadline_s: float = 15) -> None:
    """SIGKILL every process in cgroup `parent` (frozen first, so none forks away)."""
    freezer = Path("/sys/fs/cgroup/freezer", parent.lstrip("/"), "freezer.state")
    frozen = False
    if freezer.exists():
        with contextlib.suppress(OSError):
            freezer.write_text("FROZEN")
            frozen = True
            wait_for("freezing", lambda: freezer.read_text().strip() == "FROZEN", 10)
    for pid in procs_in_cgroups(parent):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if frozen:
        with contextlib.suppress(OSError):
            freezer.write_text("THAWED")
    wait_for(
        f"the processes of cgroup {parent} to exit",
        lambda: not procs_in_cgroups(parent),
        deadline_s,
    )


def remove_cgroup_tree(parent: str) -> list[str]:
    problems = []
    for root in cgroup_dirs(parent):
        for dirpath, _dirs, _files in os.walk(root, topdown=False):
            try:
                os.rmdir(dirpath)
            except OSError as exc:
                problems.append(f"cgroup {dirpath}: {exc.strerror}")
    return problems


def members(namespaces: Iterable[str], marker: str) -> list[int]:
    """Processes in one of `namespaces` (ids like `mnt:[4026532398]`) whose command line
    names `marker` (the engine's folder): its containerd and shims, nothing else."""
    wanted = set(namespaces)
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if marker not in " ".join(proc.info["cmdline"] or ()):
                continue
            if ns_id(proc.pid, "mnt") in wanted or ns_id(proc.pid, "net") in wanted:
                found.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return found


def terminate(procs: Iterable[Proc], deadline_s: float) -> None:
    """SIGTERM each (if still the same process), SIGKILL what is left after the deadline."""
    live = []
    for p in procs:
        if p.alive():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(p.pid)
                proc.terminate()
                live.append(proc)
    _gone, alive = psutil.wait_procs(live, timeout=deadline_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
