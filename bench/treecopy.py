"""Copy: `copy_execution_tree` of a 400 MiB mixed tree vs `cp -a` of it.

What a sample holds: only the copy. Its start finds no dirty pages (the previous copy's
writeback is done: `os.sync()` outside the timed window), the source in the page cache
(written, synced and copied once before the first sample), and no deletion running
(every copy is kept until the end: freeing 400 MiB on an ext4 mounted with `discard`
made the next copy up to 2x slower, whichever tool made it). The two tools alternate
which goes first in each round. Each sample's CPU time (this thread's for ours,
the child's for `cp`) is kept beside its wall time: on a shared host the wall time
swings with the CPU others take, the CPU time much less, so the spread of wall times
(max/min, reported for both tools) says how loaded the host was, and the CPU-time
ratio says what the copy itself costs.
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import MIB, Bench, BenchError, tree_bytes
from bench.results import CopyDetail, Goal, Row, make_row
from sandbox.prepare.copytree import copy_execution_tree


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


def bench_copy(b: Bench) -> list[Row]:
    s = b.sizes
    src = b.work / "copy-src" / "execution"
    b.say(f"copy: writing a {s.copy_mib} MiB tree")
    detail = make_tree(src, s.copy_mib * MIB)
    b.results.copy_tree = detail

    def ours(dst: Path) -> tuple[float, float]:
        dst.mkdir()
        cpu = _cpu(resource.RUSAGE_THREAD)
        t = time.perf_counter()
        report = copy_execution_tree(src, dst, cap_bytes=512 * MIB)
        elapsed = time.perf_counter() - t
        cpu = _cpu(resource.RUSAGE_THREAD) - cpu
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

    dests = b.work / "copy-dst"
    dests.mkdir()
    ours(dests / "warm-ours")
    cp(dests / "warm-cp")
    for i in range(s.copy_reps):
        order = ("ours", "cp") if i % 2 == 0 else ("cp", "ours")
        for which in order:
            os.sync()  # the last copy's dirty pages are written before, not during, this one
            if which == "ours":
                elapsed, cpu = ours(dests / f"ours-{i}")
                detail.ours_s.append(round(elapsed, 4))
                detail.ours_cpu_s.append(round(cpu, 4))
            else:
                elapsed, cpu = cp(dests / f"cp-{i}")
                detail.cp_s.append(round(elapsed, 4))
                detail.cp_cpu_s.append(round(cpu, 4))
            b.say(f"copy: {which} {elapsed:.2f} s (cpu {cpu:.2f} s)")
    os.sync()  # the last copy's writeback does not land in the next benchmark either
    shutil.rmtree(dests)
    mb = detail.tree_bytes / 1e6
    ours_spread, cp_spread = spread(detail.ours_s), spread(detail.cp_s)
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
                f"{detail.files} files, {detail.dirs} dirs; median of {s.copy_reps}; ours"
                f" {min(detail.ours_s):.2f}-{max(detail.ours_s):.2f} s, cp"
                f" {min(detail.cp_s):.2f}-{max(detail.cp_s):.2f} s"
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
            note="wall times; cp -a's spread in the same rounds is the host's share of it",
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


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def spread(samples: list[float]) -> float | None:
    """max/min of the samples (1.0: all alike); None without a positive sample."""
    positive = [x for x in samples if x > 0]
    return max(positive) / min(positive) if positive else None
