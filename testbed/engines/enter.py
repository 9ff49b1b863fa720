"""Enter a second engine's private namespaces, then become its dockerd (same pid).

Run by `second_engine.SecondEngine.start` as `python -I enter.py SPEC_JSON`, never by
hand. The process:

1. asks for SIGTERM when its parent (the test session) dies, so a killed session's
   dockerd shuts itself down (a later sweep removes what it leaves);
2. unshares a mount and a network namespace, marks every mount a slave (nothing it
   mounts reaches the host; mounts under the host's shared folders reach it);
3. drops its copies of mounts it does not need: other programs' run disks, overlays,
   network-namespace files (copies held here would keep them alive after their owners
   unmount them);
4. mounts a private tmpfs on /run/containerd (no system containerd is found, so
   dockerd supervises its own; shim sockets and runc state stay private), and, for
   userns-remap, bind-mounts the engine's own subuid/subgid files over /etc/subuid and
   /etc/subgid: only this namespace (dockerd and every process it starts) sees them;
5. brings loopback up in the new network namespace and execs dockerd.

Standard library only (it runs before anything is installed in the namespace).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import json
import os
import re
import signal
import socket
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND, MS_REC, MS_SLAVE = 4096, 16384, 1 << 19
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
# Mount types that are never part of the system layout a daemon needs.
TRANSIENT_TYPES = {"nsfs", "overlay"}

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {target}")


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as three octal digits."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts() -> list[tuple[str, str]]:
    """(mount point, fs type) of this namespace, in mount order."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            out.append((_unescape(fields[4]), fields[fields.index("-") + 1]))
    return out


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _keep(point: str, fstype: str, needed: list[str], shares: list[str]) -> bool:
    """Whether the daemon needs this mount: the system layout, what leads to the paths
    it uses, and the shared folders with everything mounted in them."""
    if point == "/" or any(_within(point, top) for top in ("/proc", "/sys", "/dev")):
        return True
    if any(_within(point, s) for s in shares):
        return True
    if any(_within(path, point) for path in needed):
        return True
    return point.count("/") == 1 and fstype not in TRANSIENT_TYPES


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def main() -> None:
    spec = json.loads(sys.argv[1])
    parent = spec["pdeathsig_parent"]
    if parent is not None:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "prctl")
        if os.getppid() != parent:
            raise SystemExit("enter: the session that started the engine is gone")
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare")
    _mount(None, "/", None, MS_REC | MS_SLAVE, "")
    needed, shares = spec["needed_paths"], spec["shares"]
    for point, fstype in reversed(_mounts()):
        # Only this namespace's copy goes; a copy under another one already went.
        if (
            not _keep(point, fstype, needed, shares)
            and _libc.umount2(point.encode(), MNT_DETACH) != 0
            and ctypes.get_errno() not in (2, 22)
        ):
            _check(-1, f"umount {point}")
    _mount("tmpfs", "/run/containerd", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0711")
    for private, host in spec["binds"]:
        _mount(private, host, None, MS_BIND, "")
    _loopback_up()
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


if __name__ == "__main__":
    try:
        main()
    except OSError as exc:
        print(f"enter: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
