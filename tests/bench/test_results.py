"""The bench's arithmetic and its table, without an engine (no timing is asserted here:
speed targets live in `make bench`, not in tests)."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench.common import log_sync_alone
from bench.egress import per_get_ms
from bench.harness import LOAD_RESULTS_PATH, RESULTS_PATH, main
from bench.results import (
    BenchResults,
    Goal,
    HostInfo,
    LatencyStats,
    PhaseBreakdown,
    Row,
    fmt_value,
    format_table,
    make_row,
    paired_ratio,
    percentile,
    ratio,
    status_row,
)
from bench.summary import (
    GOAL_ROWS,
    ON_REQUEST_NOTE,
    README_END,
    README_START,
    cluster_table,
    figure_cell,
    load_saved,
    missing_routes,
    readme_block,
    replace_block,
)
from sandbox.contracts.record import RunStatus, TestRunRecord


def test_ratio_is_ours_over_baseline_and_none_when_undefined() -> None:
    assert ratio(3.0, 1.5) == 2.0
    assert ratio(0.5, 2.0) == 0.25
    assert ratio(None, 1.0) is None
    assert ratio(1.0, None) is None
    assert ratio(1.0, 0.0) is None


@pytest.mark.parametrize(
    ("goal", "ours", "baseline", "expected"),
    [
        (Goal(kind="ratio_max", threshold=2.0), 2.0, 1.0, True),  # at most 2x: the edge counts
        (Goal(kind="ratio_max", threshold=2.0), 2.01, 1.0, False),
        (Goal(kind="ratio_min", threshold=0.8), 80.0, 100.0, True),  # at least 0.8 of cp
        (Goal(kind="ratio_min", threshold=0.8), 79.0, 100.0, False),
        (Goal(kind="added_max", threshold=1.0), 1.2, 0.3, True),  # 0.9 ms added < 1 ms
        (Goal(kind="added_max", threshold=1.0), 1.3, 0.3, False),  # exactly 1 ms is not under
        (Goal(kind="abs_min", threshold=1000), 1001, None, True),
        (Goal(kind="abs_min", threshold=1000), 1000, None, False),
        (Goal(kind="abs_max", threshold=60), 59.9, 20.0, True),
        (Goal(kind="abs_max", threshold=60), 60.0, 20.0, False),
        (Goal(kind="none"), 1.0, 1.0, None),
        (Goal(kind="ratio_max", threshold=2.0), 1.0, None, None),  # no baseline, no verdict
        (Goal(kind="ratio_max", threshold=2.0), None, 1.0, None),
    ],
)
def test_goal_verdicts(
    goal: Goal, ours: float | None, baseline: float | None, expected: bool | None
) -> None:
    assert goal.met(ours, baseline) is expected


def test_check_goals_take_the_check() -> None:
    goal = Goal(kind="check", text="all pass")
    assert goal.met(1.0, 2.0, check=True) is True
    assert goal.met(1.0, 2.0, check=False) is False
    assert goal.met(1.0, 2.0) is None


def test_make_row_fills_ratio_and_verdict() -> None:
    row = make_row(
        "startup",
        "start-up",
        "s",
        1.5,
        0.5,
        Goal(kind="ratio_max", threshold=2.0, text="<= 2x"),
        baseline_name="docker run --rm",
    )
    assert row.ratio == pytest.approx(3.0)
    assert row.met is False
    assert row.status == "measured"


def test_a_paired_ratio_is_the_median_of_the_pairs_own_ratios() -> None:
    # the host slowed down for one pair: both arms moved, the guard's more
    pairs = [(1100.0, 1200.0), (1150.0, 1180.0), (300.0, 700.0), (1050.0, 1100.0)]
    assert paired_ratio(pairs) == pytest.approx((1100 / 1200 + 1050 / 1100) / 2)
    # however bad one pair is, it does not decide the figure
    worse = [*pairs[:2], (10.0, 700.0), pairs[3]]
    assert paired_ratio(worse) == paired_ratio(pairs)
    assert paired_ratio([]) is None
    assert paired_ratio([(1.0, 0.0)]) is None


def test_a_row_with_a_paired_ratio_judges_that_ratio_not_its_medians() -> None:
    goal = Goal(kind="ratio_min", threshold=0.9, text=">= 0.9x")
    # the medians of the two arms taken apart say 0.85x; the pairs say 0.93x
    row = make_row("egress_rate", "100 MiB GET", "MB/s", 850.0, 1000.0, goal, paired=0.93)
    assert row.ratio == pytest.approx(0.93)
    assert row.met is True
    assert (row.ours, row.baseline) == (850.0, 1000.0)
    unpaired = make_row("egress_rate", "100 MiB GET", "MB/s", 850.0, 1000.0, goal)
    assert unpaired.met is False


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (1.23456, "s", "1.235 s"),
        (123.4, "s", "123.4 s"),
        (0.2851, "ms", "0.29 ms"),
        (1234.4, "MB/s", "1,234 MB/s"),
        (3747.0, "calls/s", "3,747 calls/s"),
        (87.64, "MB", "87.6 MB"),
        (1.874, "x", "1.87x"),
        (None, "s", "-"),
    ],
)
def test_values_print_with_their_unit(value: float | None, unit: str, text: str) -> None:
    assert fmt_value(value, unit) == text


def _rows() -> list[Row]:
    return [
        make_row(
            "copy",
            "copy: tree",
            "MB/s",
            600.0,
            800.0,
            Goal(kind="ratio_min", threshold=0.8, text=">= 0.8x cp"),
            baseline_name="cp -a",
        ),
        make_row(
            "guard_latency",
            "guard: latency",
            "ms",
            1.1,
            0.3,
            Goal(kind="added_max", threshold=1.0, text="< 1 ms added"),
        ),
        status_row("mcp_latency", "mcp: latency", "not measured", "skipped"),
    ]


def test_plain_table_is_aligned_with_one_line_per_row() -> None:
    text = format_table(_rows())
    lines = text.splitlines()
    assert lines[0].split() == ["figure", "ours", "baseline", "ratio", "goal", "met?"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert len(lines) == 2 + 3
    copy, guard, mcp = lines[2:]
    assert "600 MB/s" in copy and "800 MB/s (cp -a)" in copy and "0.75x" in copy
    assert copy.rstrip().endswith("NO")
    assert "1.10 ms" in guard and "3.67x" in guard and guard.rstrip().endswith("yes")
    assert mcp.rstrip().endswith("not measured")
    # Columns line up: every row's ratio starts where the header's does.
    col = lines[0].index("ratio")
    assert copy[col:].startswith("0.75x") and guard[col:].startswith("3.67x")


def test_markdown_table_escapes_pipes() -> None:
    rows = [make_row("x", "a | b", "s", 1.0, 2.0)]
    text = format_table(rows, markdown=True)
    lines = text.splitlines()
    assert lines[0] == "| figure | ours | baseline | ratio | goal | met? |"
    assert lines[1] == "|---|---|---|---|---|---|"
    assert lines[2].startswith("| a \\| b | 1.000 s | 2.000 s | 0.50x |")


def test_percentiles_and_latency_stats() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile([5.0], 99) == 5.0
    stats = LatencyStats.from_us([1000, 2000, 3000, 4000])
    assert stats.n == 4
    assert stats.median_ms == 2.5
    assert stats.mean_ms == 2.5
    assert stats.p99_ms == 4.0


def test_phase_breakdown_puts_the_rest_in_other() -> None:
    record = TestRunRecord(
        id="test-1",
        workflow_dir="/wf",
        workflow_name="wf",
        step_id="s",
        group="g",
        command="true",
        status=RunStatus.PASSED,
        started_at=datetime.now(UTC),
    )
    record.phases.prepare_s = 0.25  # includes copy and db copy
    record.phases.copy_s = 0.05
    record.phases.db_copy_s = 0.15
    record.phases.container_start_s = 1.0
    record.phases.step_s = 0.1
    record.phases.collect_s = 0.2
    phases = PhaseBreakdown.of(record, wall_s=1.6)
    assert phases.other_s == pytest.approx(0.05)
    assert "container start 1.000" in phases.text()


def test_results_round_trip_and_markdown_from_a_saved_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = BenchResults(
        started_at=datetime.now(UTC),
        host=HostInfo(
            cpus=2,
            memory_mb=1024,
            kernel="6",
            python="3.11",
            docker="20",
            loadavg_at_start=(0.0, 0.0, 0.0),
            foreign_containers_at_start=0,
        ),
        rows=_rows(),
    )
    out = tmp_path / "results.json"
    out.write_text(results.model_dump_json(indent=2))
    assert BenchResults.model_validate_json(out.read_text()) == results
    assert main(["--markdown", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("| figure | ours |")
    assert "| copy: tree | 600 MB/s | 800 MB/s (cp -a) | 0.75x | >= 0.8x cp | NO |" in printed


def test_a_copy_spread_is_max_over_min() -> None:
    from bench.treecopy import spread

    assert spread([0.5, 1.0, 0.8]) == pytest.approx(2.0)
    assert spread([0.7]) == pytest.approx(1.0)
    assert spread([]) is None


def test_the_cluster_benchmark_runs_only_when_named() -> None:
    """A plain `make bench` never stands up a cluster: `kubernetes` is selectable by
    `--only` but not among the benchmarks every run makes."""
    from bench.harness import ALL_BENCHMARKS, BENCHMARKS, ON_REQUEST

    assert "kubernetes" in ON_REQUEST and "kubernetes" in BENCHMARKS
    assert "kubernetes" not in ALL_BENCHMARKS


def test_a_proxys_cpu_per_get_is_its_cgroups_count_over_the_gets() -> None:
    assert per_get_ms(1_000_000, 61_000_000, 120) == 0.5  # 60 ms over 120 GETs
    assert per_get_ms(None, 61_000_000, 120) is None  # cgroups not visible
    assert per_get_ms(1_000_000, None, 120) is None
    assert per_get_ms(1_000_000, 2_000_000, 0) is None  # no GET: no figure


def test_the_sync_floor_can_space_its_syncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The egress floor's syncs are spaced as the guard's (one per request), untimed."""
    slept: list[float] = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: None)
    monkeypatch.setattr(time, "sleep", slept.append)
    assert len(log_sync_alone(tmp_path, 3, 0.001)) == 3
    assert slept == [0.001] * 3
    assert len(log_sync_alone(tmp_path, 2)) == 2
    assert slept == [0.001] * 3  # back to back: no sleep
    assert list(tmp_path.iterdir()) == []


SAVED_RUNS = (RESULTS_PATH, LOAD_RESULTS_PATH)


@pytest.mark.parametrize("path", SAVED_RUNS, ids=lambda p: p.name)
def test_each_saved_run_measures_every_route_against_its_floor(path: Path) -> None:
    """Every route a step's call can take has its row, with a baseline from the same run."""
    assert missing_routes(load_saved(path)) == []


@pytest.mark.parametrize("path", SAVED_RUNS, ids=lambda p: p.name)
def test_each_saved_run_judges_every_goal_of_the_issue(path: Path) -> None:
    rows = {row.key: row for row in load_saved(path).rows}
    for key in GOAL_ROWS:
        assert key in rows, key
        assert rows[key].goal.kind != "none", key
        assert rows[key].met is not None, key


def test_the_readme_shows_the_saved_runs_goals_table() -> None:
    readme = (RESULTS_PATH.parents[1] / "README.md").read_text()
    block = readme_block(load_saved(RESULTS_PATH), load_saved(LOAD_RESULTS_PATH))
    assert block in readme, "README's goals table drifted: python -m bench.harness --readme"


def test_a_goal_figure_reads_as_its_goal_judges_it() -> None:
    by_ratio = make_row("r", "r", "s", 0.9, 0.5, Goal(kind="ratio_max", threshold=1.6))
    added = make_row("a", "a", "ms", 1.5, 1.0, Goal(kind="added_max", threshold=1.0))
    absolute = make_row("c", "c", "calls/s", 2500.0, 9000.0, Goal(kind="abs_min", threshold=3000))
    assert figure_cell(by_ratio) == "1.80x (not met)"
    assert figure_cell(added) == "+0.50 ms (met)"
    assert figure_cell(absolute) == "2,500 calls/s (not met)"
    assert figure_cell(None) == "not measured"


def test_the_readme_block_is_replaced_whole() -> None:
    text = f"before\n{README_START}\nold\n{README_END}\nafter\n"
    assert replace_block(text, "NEW") == "before\nNEW\nafter\n"
    with pytest.raises(ValueError):
        replace_block("no block here", "NEW")


def _saved(rows: list[Row]) -> BenchResults:
    return BenchResults(
        started_at=datetime.now(UTC),
        host=HostInfo(
            cpus=2,
            memory_mb=1024,
            kernel="6",
            python="3.11",
            docker="20",
            loadavg_at_start=(0.0, 0.0, 0.0),
            foreign_containers_at_start=0,
        ),
        rows=rows,
    )


def _fleet_row(ours: float) -> Row:
    return make_row(
        "kubernetes_fleet_startup",
        "start-up on a cluster: no-op run placed by the scheduler (submit to record read)",
        "s",
        ours,
        2.0,
        baseline_name="bare `true` Pod, created to its container's end",
        note="median of 7, the local test cluster (two nodes), runs landed on 127.0.0.1",
    )


def test_the_cluster_table_shows_the_fleets_start_up_against_a_bare_pod() -> None:
    table = cluster_table(_saved([_fleet_row(9.0)]))
    fleet = next(line for line in table.splitlines() if "placed by the scheduler" in line)
    assert "| 4.50x | 9.000 s | 2.000 s | the local test cluster (two nodes)" in fleet
    pod = next(line for line in table.splitlines() if "as a Pod" in line)
    assert "| not measured |" in pod
    assert table in readme_block(_saved([_fleet_row(9.0)]), _saved([]))


def test_cluster_figures_join_the_saved_run_and_outlive_a_full_run_without_a_cluster() -> None:
    """`make bench-kubernetes` puts its rows in the saved run in place of the old ones;
    a full `make bench` (no cluster) keeps them, unless it measured them itself."""
    from bench.harness import cluster_rows, with_rows

    old, new = _fleet_row(9.0), _fleet_row(8.0)
    saved = _saved([*_rows(), old])
    saved.notes = ["a note of the full run", f"{ON_REQUEST_NOTE} yesterday"]
    merged = with_rows(saved, [new], note=f"{ON_REQUEST_NOTE} today")
    assert [r for r in merged.rows if r.key == new.key] == [new]
    assert len(merged.rows) == len(saved.rows)
    assert merged.notes == ["a note of the full run", f"{ON_REQUEST_NOTE} today"]
    assert cluster_table(merged).endswith("The cluster rows come from a run of today.")
    full = _saved(_rows())
    assert cluster_rows(merged, full) == [new]
    assert cluster_rows(merged, _saved([*_rows(), old])) == []
