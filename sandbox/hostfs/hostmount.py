"""Mounting and unmounting on the host, by system call (no `mount` process per run).

The runner mounts two things per test run below the run root, and nothing else: the
step's disk (`sandbox.stepfs.disk`) and its view of the workflow folder
(`sandbox.stepfs.view`). This module is the one place that calls mount(2) and
umount2(2) and reads `/proc/self/mountinfo`, so `sandbox gc` can find every mount a dead
runner left below a run root.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path
from typing import Final

MS_RDONLY: Final = 1
MS_NOSUID: Final = 2
MS_NODEV: Final = 4
MS_NOEXEC: Final = 8
MS_NOATIME: Final = 1024
_MNT_DETACH: Final = 2

# The C library the interpreter itself is linked with (dlopen(NULL)), not one looked up
# by name: `ctypes.util.find_library` runs `ldconfig -p` in a new process, paid by every
# CLI start that imports this module.
_libc = ctypes.CDLL(None, use_errno=True)


def mount(source: str, target: Path, fstype: str, flags: int, data: str) -> None:
    """mount(2); OSError naming both ends when the kernel refuses."""
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), flags, data.encode()):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def unmount(target: Path) -> bool:
    """Unmount ``target``; a path that is no mount point is fine. A busy mount is
    detached lazily (it goes once its last user does): False says so."""
    path = str(target).encode()
    if _libc.umount2(path, 0) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOENT):
        return True
    if _libc.umount2(path, _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise OSError(err, f"umount {target}: {os.strerror(err)}")
    return False


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as three octal digits."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points() -> list[str]:
    """Every mount point of the runner's mount namespace."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as handle:
        for line in handle:
            fields = line.split()
            if len(fields) > 4:
                points.append(_unescape(fields[4]))
    return points


def is_mount_point(path: Path) -> bool:
    return str(path) in mount_points()


def mounts_below(root: Path) -> list[str]:
    """The mount points below ``root``, deepest first (the order to unmount them in)."""
    prefix = str(root) + "/"
    return sorted((p for p in mount_points() if p.startswith(prefix)), key=len, reverse=True)
