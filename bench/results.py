"""The bench's results: pydantic models, the ratio and goal math, and the table.

Pure (no Docker); `tests/bench/test_results.py` tests it."""

from __future__ import annotations

import math
import statistics
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from sandbox.contracts.record import TestRunRecord

GoalKind = Literal["ratio_max", "ratio_min", "added_max", "abs_max", "abs_min", "check", "none"]


RowStatus = Literal["measured", "not measured", "failed"]


class Goal(BaseModel):
    """What a figure must reach. `added_max` compares ours - baseline (same unit)."""

    kind: GoalKind = "none"
    threshold: float | None = None
    text: str = "-"

    def met(
        self, ours: float | None, baseline: float | None, check: bool | None = None
    ) -> bool | None:
        """True/False against the goal; None when there is no goal or nothing to judge."""
        if self.kind == "none":
            return None
        if self.kind == "check":
            return check
        if ours is None or self.threshold is None:
            return None
        if self.kind == "abs_max":
            return ours < self.threshold
        if self.kind == "abs_min":
            return ours > self.threshold
        if baseline is None:
            return None
        if self.kind == "added_max":
            return ours - baseline < self.threshold
        return self.met_ratio(ratio(ours, baseline))

    def met_ratio(self, r: float | None) -> bool | None:
        """A ratio goal judged on `r` (None: nothing to judge)."""
        if r is None or self.threshold is None:
            return None
        return r <= self.threshold if self.kind == "ratio_max" else r >= self.threshold


class Row(BaseModel):
    """One line of the table: our figure, the baseline's, their ratio, the goal."""

    key: str
    figure: str
    unit: str
    ours: float | None = None
    baseline: float | None = None
    baseline_name: str = ""
    ratio: float | None = None
    goal: Goal = Field(default_factory=Goal)
    met: bool | None = None
    status: RowStatus = "measured"
    note: str = ""


def ratio(ours: float | None, baseline: float | None) -> float | None:
    """ours / baseline; None when either is missing or the baseline is zero."""
    if ours is None or baseline is None or baseline == 0:
        return None
    return ours / baseline


def make_row(
    key: str,
    figure: str,
    unit: str,
    ours: float | None,
    baseline: float | None,
    goal: Goal | None = None,
    *,
    baseline_name: str = "",
    check: bool | None = None,
    note: str = "",
    paired: float | None = None,
) -> Row:
    """`paired`: the ratio as measured pair by pair (`paired_ratio`), which then is the
    row's ratio and what a ratio goal judges, in place of ours / baseline."""
    goal = goal or Goal()
    row_ratio: float | None
    if paired is not None and goal.kind in ("ratio_max", "ratio_min", "none"):
        row_ratio, met = paired, goal.met_ratio(paired) if goal.kind != "none" else None
    else:
        row_ratio, met = ratio(ours, baseline), goal.met(ours, baseline, check)
    return Row(
        key=key,
        figure=figure,
        unit=unit,
        ours=ours,
        baseline=baseline,
        baseline_name=baseline_name,
        ratio=row_ratio,
        goal=goal,
        met=met,
        note=note,
    )


def paired_ratio(pairs: list[tuple[float, float]]) -> float | None:
    """The median of ours / baseline over pairs measured side by side (each pair's two
    taken one right after the other, so the host moved both alike); None without a pair.

    On a shared host a throughput moves by more between minutes than between the two
    arms of a pair: the ratio of two medians taken apart lets one slow stretch of either
    arm decide the figure, where the median of the pairs' own ratios needs more than half
    of the pairs to move."""
    ratios = [ours / base for ours, base in pairs if base > 0]
    return statistics.median(ratios) if ratios else None


def status_row(
    key: str, figure: str, status: RowStatus, note: str, goal: Goal | None = None
) -> Row:
    """A row for a benchmark that could not measure (not measured, or failed)."""
    return Row(key=key, figure=figure, unit="", status=status, note=note, goal=goal or Goal())


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "MB/s":
        return f"{value:,.0f} MB/s"
    if unit == "calls/s":
        return f"{value:,.0f} calls/s"
    if unit == "MB":
        return f"{value:.1f} MB"
    if unit == "x":  # a factor (a spread: max/min)
        return f"{value:.2f}x"
    return f"{value:g} {unit}".strip()


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def fmt_met(row: Row) -> str:
    if row.status != "measured":
        return row.status
    if row.met is None:
        return "-"
    return "yes" if row.met else "NO"


TABLE_HEADER = ("figure", "ours", "baseline", "ratio", "goal", "met?")


def table_cells(row: Row) -> tuple[str, str, str, str, str, str]:
    baseline = fmt_value(row.baseline, row.unit)
    if row.baseline_name and row.baseline is not None:
        baseline = f"{baseline} ({row.baseline_name})"
    return (
        row.figure,
        fmt_value(row.ours, row.unit),
        baseline,
        fmt_ratio(row.ratio),
        row.goal.text,
        fmt_met(row),
    )


def format_table(rows: list[Row], *, markdown: bool = False) -> str:
    """The one table: plain text with aligned columns, or a GitHub markdown table."""
    cells = [table_cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [TABLE_HEADER, *cells]) for i in range(len(TABLE_HEADER))]

    def line(values: tuple[str, ...]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    out = [line(TABLE_HEADER), line(tuple("-" * w for w in widths))]
    out += [line(c) for c in cells]
    return "\n".join(out)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


class LatencyStats(BaseModel):
    n: int
    median_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float

    @classmethod
    def from_us(cls, samples_us: list[int] | list[float]) -> LatencyStats:
        ms = [s / 1000 for s in samples_us]
        return cls(
            n=len(ms),
            median_ms=round(statistics.median(ms), 4),
            p90_ms=round(percentile(ms, 90), 4),
            p99_ms=round(percentile(ms, 99), 4),
            mean_ms=round(statistics.fmean(ms), 4),
        )


class PhaseBreakdown(BaseModel):
    """One test run's time, from its record's phases; `other_s` is the rest of the wall time
    (engine connect, image check, lock, record writes, container removal)."""

    run_id: str
    wall_s: float
    prepare_s: float
    copy_s: float
    db_copy_s: float
    container_start_s: float
    step_s: float
    collect_s: float
    other_s: float

    @classmethod
    def of(cls, record: TestRunRecord, wall_s: float) -> PhaseBreakdown:
        p = record.phases
        counted = p.prepare_s + p.container_start_s + p.step_s + p.collect_s
        return cls(
            run_id=record.id,
            wall_s=round(wall_s, 4),
            prepare_s=round(p.prepare_s, 4),
            copy_s=round(p.copy_s, 4),
            db_copy_s=round(p.db_copy_s, 4),
            container_start_s=round(p.container_start_s, 4),
            step_s=round(p.step_s, 4),
            collect_s=round(p.collect_s, 4),
            other_s=round(max(0.0, wall_s - counted), 4),
        )

    def text(self) -> str:
        return (
            f"wall {self.wall_s:.3f} s = prepare {self.prepare_s:.3f} (copy {self.copy_s:.3f},"
            f" db copy {self.db_copy_s:.3f}) + container start {self.container_start_s:.3f}"
            f" + step {self.step_s:.3f} + collect {self.collect_s:.3f}"
            f" + other {self.other_s:.3f}"
        )


class StartupDetail(BaseModel):
    n: int
    bare_s: list[float] = Field(default_factory=list)
    # The run's two containers without sandbox (bench.startup.pod_shape).
    pod_shape_s: list[float] = Field(default_factory=list)
    noop_s: list[float] = Field(default_factory=list)  # execute_step in the bench's process
    cli_s: list[float] = Field(default_factory=list)  # `sandbox run` as a new process
    noop_median: PhaseBreakdown | None = None
    with_db_s: list[float] = Field(default_factory=list)
    with_db_median: PhaseBreakdown | None = None
    # The same no-op step with one stdio MCP server configured (its own container),
    # and with a step that makes one call to it.
    with_mcp_s: list[float] = Field(default_factory=list)
    mcp_call_s: list[float] = Field(default_factory=list)


class CopyDetail(BaseModel):
    tree_bytes: int
    files: int
    dirs: int
    symlinks: int
    place: str
    ours_s: list[float] = Field(default_factory=list)
    cp_s: list[float] = Field(default_factory=list)
    # user + system seconds of each sample (ours: the bench process's, the copy's helper
    # thread included; cp: the child's)
    ours_cpu_s: list[float] = Field(default_factory=list)
    cp_cpu_s: list[float] = Field(default_factory=list)
    # CPUs the rest of the host kept busy during each sample (its load, the copy's excluded)
    ours_others_cpus: list[float] = Field(default_factory=list)
    cp_others_cpus: list[float] = Field(default_factory=list)
    fresh_disk: bool = False  # each sample into a fresh step disk (else a host folder)


class DbDetail(BaseModel):
    db_bytes: int
    wal_bytes: int
    rows: dict[str, int]
    copy_db_s: list[float] = Field(default_factory=list)
    backup_s: list[float] = Field(default_factory=list)
    copy_db_rows_ok: bool = False
    backup_rows_ok: bool = False
    faster: str = ""


class GuardSession(BaseModel):
    durability: str  # the action log's: group or per-call
    guarded: LatencyStats
    direct: LatencyStats
    stubbed: LatencyStats
    guarded_calls_per_s: float
    direct_calls_per_s: float
    concurrent_clients: int
    concurrent: LatencyStats | None = None  # each call of the concurrent clients
    concurrent_direct: LatencyStats | None = None
    guard_handler: LatencyStats | None = None  # the guard's own duration_ms per logged call
    agentworks_bridge: dict[str, Any] = Field(default_factory=dict)  # the step's own check
    calls_logged: int = 0


class GuardDetail(BaseModel):
    design: str
    sessions: list[GuardSession] = Field(default_factory=list)
    log_sync_alone: LatencyStats | None = None  # one line's write + fdatasync, same disk


class ExecDetail(BaseModel):
    """The executor route from one step: routed calls, the stubbed call, the tools' own time."""

    design: str
    stubbed: LatencyStats
    db_query: LatencyStats
    file_read: LatencyStats
    sqlite_alone: LatencyStats  # the same query on the DB copy, in the step's process
    read_alone: LatencyStats  # the same file read, in the step's process
    shell: LatencyStats | None = None  # execute_shell_command `true`, routed
    spawn_alone: LatencyStats | None = None  # /bin/sh -c true started and waited for, in-step


class ScaleDetail(BaseModel):
    runs: int
    statuses_concurrent: list[str] = Field(default_factory=list)
    statuses_sequential: list[str] = Field(default_factory=list)
    sequential_run_s: list[float] = Field(default_factory=list)
    sequential_wall_s: float = 0.0
    concurrent_wall_s: float = 0.0
    host_used_idle_mb: float = 0.0
    concurrent_peak_mb_per_run: float = 0.0
    sequential_peak_mb_per_run: float = 0.0
    guard_rss_mb: list[float] = Field(default_factory=list)
    upstream_rss_mb: float | None = None
    step_peak_mb: list[float] = Field(default_factory=list)
    sequential_cpu_busy: float = 0.0  # share of all CPUs' time that was busy (host-wide)
    concurrent_cpu_busy: float = 0.0
    sequential_median: PhaseBreakdown | None = None
    concurrent_median: PhaseBreakdown | None = None


class McpDetail(BaseModel):
    server: str
    tool: str
    client: str = ""
    protocol: dict[str, str] = Field(default_factory=dict)  # target -> negotiated version
    guarded: LatencyStats | None = None
    mcp_proxy: LatencyStats | None = None
    direct_call: LatencyStats | None = None
    direct_list: LatencyStats | None = None
    # the streamable-HTTP server: through the guard, and straight from the guard's namespace
    guarded_http: LatencyStats | None = None
    http_direct: LatencyStats | None = None


class EgressDetail(BaseModel):
    big_bytes: int
    # "guard/new", "squid/keep", ...: the small GETs of each target, by connection mode
    small: dict[str, LatencyStats] = Field(default_factory=dict)
    mb_s: dict[str, list[float]] = Field(default_factory=dict)  # the big GET, by target
    # CPU the proxy's container used during the big GET, ms, by proxy (its cgroup's count)
    big_cpu_ms: dict[str, list[float]] = Field(default_factory=dict)
    # CPU the proxy's container used per small GET, ms, by "target/mode" (one per round)
    small_cpu_ms: dict[str, list[float]] = Field(default_factory=dict)
    log_sync_alone: LatencyStats | None = None  # one line's write + fdatasync, same disk
    # one A query's answer from 127.0.0.11:53: "guard" (the step's uid, redirected to the
    # guard's own DNS), "engine" (the guard's uid, the engine's resolver)
    dns: dict[str, LatencyStats] = Field(default_factory=dict)


class HostInfo(BaseModel):
    cpus: int
    memory_mb: int
    kernel: str
    python: str
    docker: str
    loadavg_at_start: tuple[float, float, float]
    foreign_containers_at_start: int  # running containers the bench did not make (noise)


class BenchResults(BaseModel):
    schema_version: Literal[1] = 1
    started_at: datetime
    duration_s: float = 0.0
    complete: bool = False  # every benchmark ran with full sizes
    load: bool = False  # run with --load: the CPU and disk hogs beside every figure
    host: HostInfo
    rows: list[Row] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    startup: StartupDetail | None = None
    copy_tree: CopyDetail | None = None
    db_copy: DbDetail | None = None
    guard: GuardDetail | None = None
    executor: ExecDetail | None = None
    scale: ScaleDetail | None = None
    mcp: McpDetail | None = None
    egress: EgressDetail | None = None
