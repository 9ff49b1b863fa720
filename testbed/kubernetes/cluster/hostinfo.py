"""What the host's /proc says about namespaces, cgroups and mounts (read only).

Processes are found by identity (their namespace or cgroup), never by name, so
stopping a cluster never touches another cluster's or the host's processes.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil


def ns_id(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def cgroup_hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, the named systemd one, unified)."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype in ("cgroup", "cgroup2"):
                found.append(Path(fields[4]))
    return sorted(set(found))


def procs_in_cgroup_tree(root: Path) -> set[int]:
    pids: set[int] = set()
    for dirpath, _dirs, _files in os.walk(root):
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in Path(dirpath, "cgroup.procs").read_text().split())
    return pids


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in this (the host's) mount namespace."""
    prefix = str(path)
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            if point == prefix or point.startswith(prefix + "/"):
                out.append(point)
    return out


def holders_of(path: Path, limit: int = 10) -> list[str]:
    """Processes that keep `path` busy: a working directory, root or open file below it,
    or a mount namespace of their own with a mount below it (what `umount` calls busy)."""
    prefix = str(path)
    own_ns = ns_id(os.getpid(), "mnt")

    def below(p: str) -> bool:
        return p == prefix or p.startswith(prefix + "/")

    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        why = []
        try:
            if below(proc.cwd()):
                why.append("cwd")
            if below(os.readlink(f"/proc/{proc.pid}/root")):
                why.append("root")
            if any(below(f.path) for f in proc.open_files()):
                why.append("open file")
            if ns_id(proc.pid, "mnt") != own_ns:
                with open(f"/proc/{proc.pid}/mountinfo") as f:
                    if any(below(line.split()[4]) for line in f):
                        why.append("a mount in its namespace")
        except (psutil.Error, OSError):
            continue
        if why:
            found.append(f"{proc.pid} {proc.info['name']} ({', '.join(why)})")
        if len(found) >= limit:
            break
    return found


def mounted_anywhere(path: str) -> bool:
    """Whether any live mount namespace on the host has a mount at `path`."""
    seen: set[str] = set()
    for pid in psutil.pids():
        try:
            ns = ns_id(pid, "mnt")
            if ns in seen:
                continue
            seen.add(ns)
            with open(f"/proc/{pid}/mountinfo") as f:
                if any(line.split()[4] == path for line in f):
                    return True
        except OSError:
            continue
    return False
