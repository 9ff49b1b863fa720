"""When a host process started, read from `/proc` as psutil reads it.

A run's record, its containers' labels and the workflow lock's sidecars name their
runner by pid and start time, and `sandbox gc` and the lock tell a live runner from a
reused pid by comparing that start time with psutil's (`psutil.Process.create_time()`).
The runner itself only needs its own start time, and importing psutil for it cost every
`sandbox run` some 10 to 15 ms of start-up (its native module and platform layer): this
is the same arithmetic on the same two files, so the figures agree to the bit.
"""

from __future__ import annotations

import os

PROC = "/proc"


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 64 * 1024)
    finally:
        os.close(fd)


def boot_time() -> float:
    """The host's boot time in seconds since the epoch (`btime` of `/proc/stat`)."""
    for line in _read(f"{PROC}/stat").splitlines():
        if line.startswith(b"btime"):
            return float(line.split()[1])
    raise OSError(f"no btime line in {PROC}/stat")


def process_start(pid: int) -> float:
    """Process `pid`'s start time in seconds since the epoch, as psutil's `create_time()`
    computes it: the `starttime` field of `/proc/PID/stat` (clock ticks since boot) over
    the clock's ticks per second, plus the boot time. OSError when there is no such
    process (or its stat is unreadable)."""
    stat = _read(f"{PROC}/{int(pid)}/stat")
    # The command name (field 2) is in parentheses and may hold spaces or ')': the
    # fields after the last ')' start at the state (field 3); starttime is field 22.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        raise OSError(f"{PROC}/{pid}/stat has too few fields")
    return float(fields[19]) / os.sysconf("SC_CLK_TCK") + boot_time()
