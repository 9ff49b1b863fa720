"""Copy: `copy_execution_tree` of a 400 MiB mixed tree vs `cp -a` of it.

What a sample holds: only the copy, from the source (on the host's file system, in the
page cache: read through once before every sample) into a file system made for that
sample alone, of the kind a run copies into: a fresh step disk (`StepDisk`: a sparse
ext4 image in the bench's folder, on the same disk as the source, loop-mounted), synced
before the timed window and unmounted and deleted after it. Both tools get the same.

Why a fresh file system per sample, not a folder next to the source on the host's
(which is what made the samples spread 6x): on the host's ext4 (no journal) every new
inode is placed by scanning the inode bitmap of its group, and each free slot whose
inode was deleted in the last minute (six, while its table block is dirty) costs a
buffer-cache lookup before it is skipped; a host shared with other work deletes
thousands of files a minute, so one copy's 3,450 inodes cost anything from nothing to
most of its time (seen in kernel profiles of both tools: up to 40% of a copy's samples
in `recently_deleted`). And every copy kept in the page cache took 400 MiB of memory the
VM had never backed (its balloon hands freed pages back to the host), whose first touch
costs more than the copy: the samples grew from 0.26 s to 1.6 s as the copies piled up,
for both tools alike. A fresh disk per sample has neither: no deleted inodes, and the
memory it writes into is what the previous sample's disk gave back when it was deleted.
It is also where a run's copy goes (`prepare` copies the real run's tree into the run's
new step disk). Without root (no loop mounts) the samples fall back to folders on the
host's file system (`os.sync()` before each), and a note says so.

What it cannot take out is the CPU that other work takes: the copy is CPU-bound (kernel
page-cache copies), so on a shared 2-CPU host its wall time is its CPU time divided by
the share it gets. Each sample keeps its CPU time (this process's for ours, the copy's
helper thread included; the child's for `cp`) and the CPUs the rest of the host used
while it ran (`/proc/stat`, minus the copy's own); the two tools alternate which goes
first in each round.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.common import MIB, Bench, BenchError, tree_bytes
from bench.results import CopyDetail, Goal, Row, make_row
from sandbox.contracts.layout import RunLayout
from sandbox.prepare.copytree import copy_execution_tree
from sandbox.stepfs.disk import DiskError, StepDisk

# Each sample's disk: the tree plus room for ext4's own metadata.
DISK_SLACK_BYTES = 256 * MIB


def make_tree(root: Path, total_bytes: int, seed: int = 7) -> CopyDetail:
    """A mixed execution tree of real (random) bytes: many small files in nested folders,
    some medium ones, a few large ones, and a few symlinks."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    written = files = dirs = 0

    def write(path: Path, size: int) -> None:
        nonlocal written, files
        with open(path, "wb") as handle:
            left = size
            while left:
                chunk = min(left, 8 * MIB)
                handle.write(rng.randbytes(chunk))
                left -= chunk
        written += size
        files += 1

    small_budget = total_bytes * 12 // 100
    medium_budget = total_bytes * 33 // 100
    i = 0
    while written < small_budget:
        folder = root / "src" / f"pkg{i % 40:02}" / f"mod{i % 7}"
        if not folder.exists():
            folder.mkdir(parents=True)
        write(folder / f"f{i:05}.txt", rng.randint(512, 32 * 1024))
        i += 1
    (root / "data").mkdir()
    j = 0
    while written < small_budget + medium_budget:
        write(root / "data" / f"m{j:03}.bin", rng.randint(256 * 1024, 3 * MIB))
        j += 1
    (root / "blobs").mkdir()
    rest = total_bytes - written
    for k in range(3):
        write(root / "blobs" / f"large{k}.bin", rest // 3 if k < 2 else rest - 2 * (rest // 3))
    (root / "links").mkdir()
    for k in range(5):
        os.symlink(f"../data/m{k:03}.bin", root / "links" / f"l{k}")
    for _dirpath, dirnames, _ in os.walk(root):
        dirs += len(dirnames)
    os.sync()
    return CopyDetail(
        tree_bytes=written, files=files, dirs=dirs, symlinks=5, place=str(root.parent)
    )


def read_through(root: Path) -> None:
    """Read every regular file under ``root`` once (links not followed): the source is in
    the page cache, in the same state, before every sample."""
    buf = bytearray(8 * MIB)
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            with open(path, "rb", buffering=0) as handle:
                while handle.readinto(buf):
                    pass


def busy_cpus_s() -> float:
    """CPU-seconds the whole host has spent busy since boot (`/proc/stat`'s first line:
    everything but idle and iowait)."""
    with open("/proc/stat") as handle:
        fields = [int(x) for x in handle.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def sample_place(b: Bench, n: int, size_bytes: int) -> Iterator[Path]:
    """A folder to copy into: the group folder of a fresh step disk made for this sample
    (deleted after it), or, without root, a new folder on the host's file system."""
    if os.geteuid() != 0:
        place = b.work / "copy-dst" / f"s{n}"
        place.mkdir(parents=True)
        os.sync()  # the last copy's dirty pages are written before, not during, this one
        yield place
        return
    root = b.work / "copy-disks" / f"s{n}"
    root.mkdir(parents=True)
    layout = RunLayout(workflow_dir=b.work, run_id=f"test-copy-{n}", group="copy", root_dir=root)
    disk = StepDisk.create(layout, size_bytes + DISK_SLACK_BYTES)
    try:
        fd = os.open(disk.mount_point, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.sync()  # nothing dirty (of the new disk, or anyone's) is written during the copy
        yield disk.group_dir
    finally:
        disk.close()
        root.rmdir()


def bench_copy(b: Bench) -> list[Row]:
    s = b.sizes
    src = b.work / "copy-src" / "execution"
    b.say(f"copy: writing a {s.copy_mib} MiB tree")
    detail = make_tree(src, s.copy_mib * MIB)
    b.results.copy_tree = detail

    def ours(dst: Path) -> tuple[float, float]:
        dst.mkdir()
        cpu = _cpu(resource.RUSAGE_SELF)
        t = time.perf_counter()
        report = copy_execution_tree(src, dst, cap_bytes=512 * MIB)
        elapsed = time.perf_counter() - t
        cpu = _cpu(resource.RUSAGE_SELF) - cpu
        if (
            report.bytes_copied != detail.tree_bytes
            or report.files_copied != detail.files
            or report.left_out
            or report.errors
            or len(report.symlinks) != detail.symlinks
        ):
            raise BenchError(f"copy_execution_tree dropped something: {report}")
        return elapsed, cpu

    def cp(dst: Path) -> tuple[float, float]:
        cpu = _cpu(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(["cp", "-a", "--", str(src), str(dst)], check=True)
        elapsed = time.perf_counter() - t
        cpu = _cpu(resource.RUSAGE_CHILDREN) - cpu
        if tree_bytes(dst) != (detail.tree_bytes, detail.files):
            raise BenchError("cp -a produced a different tree")
        return elapsed, cpu

    tools: dict[str, Callable[[Path], tuple[float, float]]] = {"ours": ours, "cp": cp}
    fresh = os.geteuid() == 0
    n = 0

    def sample(which: str) -> tuple[float, float, float]:
        """One copy in its own place: (wall s, its CPU s, the other CPUs busy meanwhile)."""
        nonlocal n
        n += 1
        read_through(src)
        try:
            with sample_place(b, n, detail.tree_bytes) as place:
                busy = busy_cpus_s()
                elapsed, cpu = tools[which](place / "tree")
                busy = busy_cpus_s() - busy
        except DiskError as exc:
            raise BenchError(f"copy: cannot make a disk to copy into: {exc}") from exc
        return elapsed, cpu, max(0.0, busy - cpu) / elapsed

    for which in tools:  # one warm-up each (imports, the tools' own first-run costs)
        sample(which)
    for i in range(s.copy_reps):
        order = ("ours", "cp") if i % 2 == 0 else ("cp", "ours")
        for which in order:
            elapsed, cpu, others = sample(which)
            if which == "ours":
                detail.ours_s.append(round(elapsed, 4))
                detail.ours_cpu_s.append(round(cpu, 4))
                detail.ours_others_cpus.append(round(others, 2))
            else:
                detail.cp_s.append(round(elapsed, 4))
                detail.cp_cpu_s.append(round(cpu, 4))
                detail.cp_others_cpus.append(round(others, 2))
            b.say(f"copy: {which} {elapsed:.2f} s (cpu {cpu:.2f} s, others {others:.2f} CPUs)")
    os.sync()  # the copies' writeback does not land in the next benchmark either
    shutil.rmtree(b.work / "copy-dst", ignore_errors=True)
    with contextlib.suppress(OSError):
        (b.work / "copy-disks").rmdir()
    detail.fresh_disk = fresh
    if not fresh:
        b.note("copy: not root, so the copies went to folders on the host's file system")
    mb = detail.tree_bytes / 1e6
    ours_spread, cp_spread = spread(detail.ours_s), spread(detail.cp_s)
    host_load = detail.ours_others_cpus + detail.cp_others_cpus
    return [
        make_row(
            "copy",
            f"copy: {s.copy_mib} MiB execution tree",
            "MB/s",
            mb / statistics.median(detail.ours_s),
            mb / statistics.median(detail.cp_s),
            Goal(kind="ratio_min", threshold=0.9, text=">= 0.9x cp"),
            baseline_name="cp -a",
            note=(
                f"{detail.files} files, {detail.dirs} dirs; median of {s.copy_reps}, each into"
                f" {'a fresh step disk' if fresh else 'a new host folder'}; ours"
                f" {min(detail.ours_s):.2f}-{max(detail.ours_s):.2f} s, cp"
                f" {min(detail.cp_s):.2f}-{max(detail.cp_s):.2f} s; per-round ratio"
                f" {_round_ratios(detail)}"
            ),
        ),
        make_row(
            "copy_spread",
            "copy: spread of its samples (max/min)",
            "x",
            ours_spread,
            cp_spread,
            Goal(kind="abs_max", threshold=2.0, text="< 2x"),
            baseline_name="cp -a's",
            note=(
                f"wall times; CPU times spread {_fmt(spread(detail.ours_cpu_s))} (ours),"
                f" {_fmt(spread(detail.cp_cpu_s))} (cp -a); the rest of the host kept about"
                f" {min(host_load):.1f}-{max(host_load):.1f} of {os.cpu_count()} CPUs busy"
                " meanwhile (/proc/stat's ticks)"
            ),
        ),
        make_row(
            "copy_cpu",
            f"copy: CPU time of one {s.copy_mib} MiB copy",
            "s",
            statistics.median(detail.ours_cpu_s),
            statistics.median(detail.cp_cpu_s),
            baseline_name="cp -a",
            note="information: user + system time, medians; what the copy itself costs",
        ),
    ]


def _round_ratios(detail: CopyDetail) -> str:
    """ours/cp throughput of each round (its two samples ran back to back): min-max."""
    ratios = [c / o for o, c in zip(detail.ours_s, detail.cp_s, strict=True) if o > 0]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def spread(samples: list[float]) -> float | None:
    """max/min of the samples (1.0: all alike); None without a positive sample."""
    positive = [x for x in samples if x > 0]
    return max(positive) / min(positive) if positive else None
