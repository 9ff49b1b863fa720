"""Scale: 10 test runs at once vs the same 10 one after another."""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import docker.errors
import psutil
from docker import DockerClient

from bench.common import (
    SCALE_STEP,
    Background,
    Bench,
    earlier_run,
    execute,
    small_db,
    upstream_server,
    wait_for,
    write_workflow,
)
from bench.results import Goal, PhaseBreakdown, Row, ScaleDetail, make_row
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.run.testrun import RunOptions, TestRun


class _Sampler:
    """Samples host memory in use and our guards' RSS until stopped (a few times a second)."""

    def __init__(self, client: DockerClient, root: Path, period_s: float = 0.2) -> None:
        self.client = client
        self.root = str(root)
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []  # (monotonic, host bytes in use)
        self.guard_rss: dict[str, int] = {}  # container id -> max RSS bytes
        self._procs: dict[str, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    @staticmethod
    def host_used() -> int:
        vm = psutil.virtual_memory()
        return int(vm.total - vm.available)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.host_used()))
            with contextlib.suppress(docker.errors.APIError, psutil.Error, KeyError):
                self._sample_guards()
            self._stop.wait(self.period_s)

    def _sample_guards(self) -> None:
        for item in self.client.api.containers(filters={"label": ["sandbox.role=guard"]}):
            if not item.get("Labels", {}).get("sandbox.run-root", "").startswith(self.root):
                continue
            rss = container_rss(self.client, item["Id"], self._procs)
            if rss is not None:
                self.guard_rss[item["Id"]] = max(self.guard_rss.get(item["Id"], 0), rss)

    def peak_between(self, start: float, end: float) -> int:
        inside = [used for t, used in self.samples if start <= t <= end]
        return max(inside) if inside else 0

    def last_before(self, moment: float) -> int:
        before = [used for t, used in self.samples if t <= moment]
        return before[-1] if before else self.host_used()


def container_rss(client: DockerClient, cid: str, cache: dict[str, psutil.Process]) -> int | None:
    """RSS of every process of a running container (its init and what that started)."""
    proc = cache.get(cid)
    if proc is None:
        pid = int(client.api.inspect_container(cid)["State"]["Pid"] or 0)
        if not pid:
            return None
        proc = cache[cid] = psutil.Process(pid)
    try:
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return None


def _busy_share(before: Any, after: Any) -> float:
    """The share of all CPUs' time between two psutil.cpu_times() that was not idle."""
    total = sum(after) - sum(before)
    idle = (after.idle - before.idle) + (after.iowait - before.iowait)
    return round((total - idle) / total, 3) if total > 0 else 0.0


def _median_phases(records: list[TestRunRecord]) -> PhaseBreakdown:
    """The phases of the run with the median duration (its own wall time, runs overlap)."""
    mid = sorted(records, key=lambda r: r.duration_s or 0.0)[len(records) // 2]
    return PhaseBreakdown.of(mid, mid.duration_s or 0.0)


def bench_scale(b: Bench) -> list[Row]:
    n = b.sizes.scale_runs
    detail = ScaleDetail(runs=n)
    b.results.scale = detail
    root = b.work / "scale"
    flows = []
    for i in range(n):
        wf = write_workflow(
            root / f"wf{i:02}",
            name=f"scale{i:02}",
            step="work",
            command=["python3", "/workflow/code/work.py"],
            extra_toml='[bridge]\nupstream = "http://jobboard:8080"\n',
            code={"work.py": SCALE_STEP},
        )
        small_db(wf / "db" / "db.sqlite")
        earlier_run(wf, files=50, each_bytes=16 * 1024)
        flows.append(wf)
    with upstream_server(b) as fake, _Sampler(b.client, root) as sampler:
        options = RunOptions(upstream_networks=(fake.network,))
        wait_for("a first memory sample", lambda: len(sampler.samples) >= 3, 10)
        detail.host_used_idle_mb = round(statistics.median(u for _, u in sampler.samples) / 1e6, 1)
        seq_peaks: list[int] = []
        seq_records: list[TestRunRecord] = []
        cpu0 = psutil.cpu_times()
        t_all = time.perf_counter()
        for i, wf in enumerate(flows):
            start = time.monotonic()
            idle = sampler.last_before(start)
            t = time.perf_counter()
            record = TestRun(wf, "work", options).execute()
            detail.sequential_run_s.append(round(time.perf_counter() - t, 3))
            detail.statuses_sequential.append(record.status.value)
            seq_records.append(record)
            seq_peaks.append(sampler.peak_between(start, time.monotonic()) - idle)
            b.say(f"scale: sequential {i + 1}/{n}: {record.status.value}")
        detail.sequential_wall_s = round(time.perf_counter() - t_all, 3)
        detail.sequential_cpu_busy = _busy_share(cpu0, psutil.cpu_times())
        detail.sequential_peak_mb_per_run = round(max(seq_peaks) / 1e6, 1)
        sampler.guard_rss.clear()

        b.say(f"scale: {n} at once")
        start = time.monotonic()
        idle = sampler.last_before(start)
        cpu0 = psutil.cpu_times()
        t_all = time.perf_counter()
        runners = [Background(functools.partial(execute, wf, "work", options)) for wf in flows]
        records = [r.join(600) for r in runners]
        detail.concurrent_wall_s = round(time.perf_counter() - t_all, 3)
        detail.concurrent_cpu_busy = _busy_share(cpu0, psutil.cpu_times())
        peak = sampler.peak_between(start, time.monotonic()) - idle
        detail.concurrent_peak_mb_per_run = round(peak / n / 1e6, 1)
        detail.statuses_concurrent = [r.status.value for r in records]
        detail.guard_rss_mb = sorted(round(v / 1e6, 1) for v in sampler.guard_rss.values())
        detail.step_peak_mb = [
            round((r.resources.peak_memory_bytes or 0) / 1e6, 1) for r in records
        ]
        with contextlib.suppress(docker.errors.APIError, psutil.Error):
            up = container_rss(b.client, fake.container_id, {})
            detail.upstream_rss_mb = None if up is None else round(up / 1e6, 1)
    failed = [
        f"{r.step_id}@{Path(r.workflow_dir).name}: {r.status.value} ({r.reason})"
        for r in records
        if r.status is not RunStatus.PASSED
    ]
    all_passed = not failed and all(st == "passed" for st in detail.statuses_sequential)
    if failed:
        b.note("scale: runs that did not pass: " + "; ".join(failed))
    detail.sequential_median = _median_phases(seq_records)
    detail.concurrent_median = _median_phases(records)
    b.note(
        f"scale: host CPU busy {detail.sequential_cpu_busy:.0%} one by one,"
        f" {detail.concurrent_cpu_busy:.0%} with {n} at once (all {os.cpu_count()} CPUs)"
    )
    b.note(f"scale, median run one by one: {detail.sequential_median.text()}")
    b.note(f"scale, median run of {n} at once: {detail.concurrent_median.text()}")
    if len(detail.guard_rss_mb) < n:
        b.note(f"scale: guard RSS sampled for {len(detail.guard_rss_mb)} of {n} guards")
    b.note(
        f"scale: {n} runs at once in {detail.concurrent_wall_s:.1f} s vs"
        f" {detail.sequential_wall_s:.1f} s one after another;"
        f" guard RSS (max per guard, MB): {detail.guard_rss_mb}; step peak"
        f" memory (MB, engine stats): {detail.step_peak_mb}; host memory in use when idle:"
        f" {detail.host_used_idle_mb:.0f} MB"
    )
    return [
        make_row(
            "scale_wall",
            f"scale: {n} runs at once, wall",
            "s",
            detail.concurrent_wall_s,
            detail.sequential_wall_s,
            Goal(kind="check", text=f"all {n} pass"),
            baseline_name="one by one",
            check=all_passed,
            note=f"{sum(st == 'passed' for st in detail.statuses_concurrent)}/{n} passed",
        ),
        make_row(
            "scale_memory",
            "scale: peak host memory per run",
            "MB",
            detail.concurrent_peak_mb_per_run,
            detail.sequential_peak_mb_per_run,
            baseline_name="one by one",
            note="host memory in use (total - available), peak minus idle, per run",
        ),
        make_row(
            "scale_guard_rss",
            "scale: guard RSS, max of the guards",
            "MB",
            max(detail.guard_rss_mb) if detail.guard_rss_mb else None,
            detail.upstream_rss_mb,
            Goal(kind="abs_max", threshold=60, text="< 60 MB"),
            baseline_name="stdlib http.server upstream",
        ),
    ]
