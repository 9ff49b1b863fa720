"""The bench's summary: every route a step's call can take, and the goals table that the
README and the performance page show, from the saved quiet and `--load` results.

Pure (no Docker). `ROUTES` names the row that measures each route against its floor in
the same run; `GOAL_ROWS` the figures issue 33 set goals for. The README's block between
`README_START` and `README_END` is `readme_block()` of the saved results (with the
cluster figures of `CLUSTER_ROWS`), written by
`python -m bench.harness --readme`; `tests/bench/test_results.py` fails when it drifts from them
or when a saved run lacks a route, so the front page never shows figures the files do
not hold.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.results import BenchResults, Row, fmt_value

# Each route a step's call can take -> the row (its key) that measures it against its floor.
ROUTES: dict[str, str] = {
    "stubbed bridge call": "guard_stub",
    "forwarded bridge call": "guard_latency",
    "executor-routed DB query": "exec_db_floor",
    "executor-routed file read": "exec_file_floor",
    "shell command start": "exec_shell_floor",
    "MCP call, stdio server": "mcp_vs_proxy",
    "MCP call, HTTP server": "mcp_http",
    "egress through the proxy": "egress_new_squid",
    "egress through transparent interception, vs Squid": "egress_new_transparent_vs_squid",
    "egress through transparent interception, vs the explicit proxy": (
        "egress_new_transparent_vs_guard"
    ),
    "DNS answer from the guard's DNS server": "dns_answer",
    "no-op run through the CLI": "startup_cli_bare",
}

# The goals table (issue 33), in its order: row key -> what the README calls the figure.
GOAL_ROWS: dict[str, str] = {
    "egress_new_squid": "small GET vs Squid, new connection",
    "egress_keep_squid": "small GET vs Squid, kept alive",
    "egress_keep_squid_p99": "small GET kept alive, p99 vs Squid's",
    "egress_rate": "100 MiB GET vs direct",
    "guard_rate": "bridge forwarded calls/s, 4 clients",
    "guard_p99": "bridge forwarded call, 4 clients, p99",
    "exec_db_floor": "executor-routed DB query vs a stubbed call + SQLite's own time",
    "exec_file_floor": "executor-routed file read vs a stubbed call + the read's own time",
    "mcp_vs_proxy": "MCP read call vs mcp-proxy, SDK client",
    "startup_cli_bare": "no-op `sandbox run` (CLI) vs bare `docker run --rm`",
}

# Figures only `make bench-kubernetes` measures (a cluster; issue 37 set no goal): row key
# -> what the README calls it. They keep their place in `bench/results.json` across full
# runs (`bench.harness`), and show as their ratio to the bare Pod of the same run.
CLUSTER_ROWS: dict[str, str] = {
    "kubernetes_startup": "no-op test run as a Pod vs a bare Pod (created to gone)",
    "kubernetes_fleet_startup": (
        "no-op run placed by the scheduler (submit to record read) vs a bare `true` Pod "
        "(created to its end)"
    ),
}

# How a saved run's note about its cluster rows begins (`bench.harness` writes it).
ON_REQUEST_NOTE = "cluster rows from a run of"

README_START = "<!-- bench:summary:start (python -m bench.harness --readme writes this block) -->"
README_END = "<!-- bench:summary:end -->"


def load_saved(path: Path) -> BenchResults:
    """A saved run's rows and header, whatever detail it kept (a file from an older bench
    may carry detail in a shape this one no longer reads)."""
    data = json.loads(path.read_text())
    keep = ("started_at", "duration_s", "complete", "load", "host", "rows", "notes")
    return BenchResults.model_validate({k: data[k] for k in keep if k in data})


def missing_routes(results: BenchResults) -> list[str]:
    """The routes whose row is absent from `results` or has no figure or no baseline."""
    rows = {row.key: row for row in results.rows}
    missing = []
    for route, key in ROUTES.items():
        row = rows.get(key)
        if row is None or row.ours is None or row.baseline is None:
            missing.append(route)
    return missing


def figure_cell(row: Row | None) -> str:
    """One goal figure as its goal judges it: a ratio, the time added, or the value."""
    if row is None or row.ours is None:
        return "not measured" if row is None else row.status
    kind = row.goal.kind
    if kind in ("ratio_max", "ratio_min") and row.ratio is not None:
        value = f"{row.ratio:.2f}x"
    elif kind == "added_max" and row.baseline is not None:
        value = f"+{row.ours - row.baseline:.2f} {row.unit}"
    else:
        value = fmt_value(row.ours, row.unit)
    verdict = {True: "met", False: "not met", None: "no verdict"}[row.met]
    return f"{value} ({verdict})"


def goals_table(quiet: BenchResults, load: BenchResults) -> str:
    """The goals table: each figure, its goal, and where the quiet and `--load` runs left it."""
    q = {row.key: row for row in quiet.rows}
    h = {row.key: row for row in load.rows}
    lines = ["| figure | goal | quiet | beside a CPU and a disk hog |", "|---|---|---|---|"]
    for key, name in GOAL_ROWS.items():
        goals = [r.goal.text for r in (q.get(key), h.get(key)) if r is not None]
        goal = " / ".join(dict.fromkeys(goals)) or "-"
        cells = [name, goal, figure_cell(q.get(key)), figure_cell(h.get(key))]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def cluster_table(quiet: BenchResults) -> str:
    """The cluster figures of the saved run: each a ratio, with both times."""
    rows = {row.key: row for row in quiet.rows}
    lines = ["| on a cluster | ratio | ours | bare Pod | measured on |", "|---|---|---|---|---|"]
    for key, name in CLUSTER_ROWS.items():
        row = rows.get(key)
        if row is None or row.ours is None or row.baseline is None or row.ratio is None:
            cells = [name, "not measured" if row is None else row.status, "-", "-", "-"]
        else:
            where = row.note.split(", ", 1)[1] if ", " in row.note else row.note
            cells = [
                name,
                f"{row.ratio:.2f}x",
                fmt_value(row.ours, row.unit),
                fmt_value(row.baseline, row.unit),
                where,
            ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    when = [n for n in quiet.notes if n.startswith(ON_REQUEST_NOTE)]
    if when:
        said = when[-1].replace(ON_REQUEST_NOTE, "The cluster rows come from a run of", 1)
        lines += ["", f"{said}."]
    return "\n".join(lines)


def readme_block(quiet: BenchResults, load: BenchResults) -> str:
    """The README's block: the goals table and the runs it comes from."""

    def when(r: BenchResults) -> str:
        return f"{r.started_at:%Y-%m-%d %H:%M} UTC, {r.duration_s:.0f} s"

    return "\n".join(
        [
            README_START,
            goals_table(quiet, load),
            "",
            cluster_table(quiet),
            "",
            f"From `bench/results.json` ({when(quiet)}) and `bench/results-load.json`"
            f" ({when(load)}), {quiet.host.cpus} CPUs.",
            README_END,
        ]
    )


def replace_block(text: str, block: str) -> str:
    """`text` with its summary block replaced by `block` (ValueError: it has none)."""
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError("no bench summary block (README_START ... README_END)")
    return text[:start] + block + text[end + len(README_END) :]
