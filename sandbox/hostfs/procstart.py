"""When a host process started, read from `/proc` as psutil reads it.

A run's record, its containers' labels and the workflow lock's sidecars name their
runner by pid and start time, and `sandbox gc` and the lock tell a live runner from a
reused pid by comparing that start time with psutil's (`psutil.Process.create_time()`).
The runner itself only needs its own start time, and importing psutil for it cost every
`sandbox run` some 10 to 15 ms of start-up (its native module and platform layer): this
is the same arithmetic on the same two files, so the figures agree to the bit.

That wall-clock figure is not a stable name for a process, though: Linux computes
`btime` afresh at every read as the wall clock less the time since boot, so a clock
step (NTP, a resumed VM) moves every process's start time by the step, and a runner
that is alive would look dead to a comparison made after it. A process is therefore
also named in the kernel's own terms, which no clock moves: its start in clock ticks
since boot and the boot it belongs to (`same_process`).
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


def boot_id() -> str:
    """This boot's random id (`/proc/sys/kernel/random/boot_id`): tick counts of two
    boots are not comparable."""
    return _read(f"{PROC}/sys/kernel/random/boot_id").decode("ascii").strip()


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of `/proc/PID/stat` from the state (field 3) on."""
    stat = _read(f"{PROC}/{int(pid)}/stat")
    # The command name (field 2) is in parentheses and may hold spaces or ')': the
    # fields after the last ')' start at the state (field 3); starttime is field 22.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        raise OSError(f"{PROC}/{pid}/stat has too few fields")
    return fields


def process_start_ticks(pid: int) -> int:
    """Process `pid`'s start in clock ticks since boot (`starttime`, field 22): what no
    clock step moves. OSError when there is no such process."""
    return int(_stat_fields(pid)[19])


def start_identity(pid: int) -> tuple[int, str] | None:
    """Process `pid`'s (start ticks, boot id), what `same_process` compares; None when
    /proc does not show them (the caller names the process by its wall-clock start)."""
    try:
        return process_start_ticks(pid), boot_id()
    except (OSError, ValueError):
        return None


def same_process(pid: int, start_ticks: int, boot: str) -> bool:
    """Whether the process that started `start_ticks` after boot `boot` under `pid` still
    runs (a zombie does not): a reused pid has a later start, another boot another id."""
    try:
        if boot_id() != boot:
            return False
        fields = _stat_fields(pid)
        return int(fields[19]) == start_ticks and fields[0] not in (b"Z", b"X")
    except (OSError, ValueError):
        return False


def process_start(pid: int) -> float:
    """Process `pid`'s start time in seconds since the epoch, as psutil's `create_time()`
    computes it: the `starttime` field of `/proc/PID/stat` (clock ticks since boot) over
    the clock's ticks per second, plus the boot time. OSError when there is no such
    process (or its stat is unreadable)."""
    return float(_stat_fields(pid)[19]) / os.sysconf("SC_CLK_TCK") + boot_time()
