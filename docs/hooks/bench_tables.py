"""mkdocs hook: the performance page's tables, rendered from the saved bench results.

`<!-- bench:quiet -->` and `<!-- bench:load -->` in a page become the table of
`bench/results.json` and `bench/results-load.json` (as `make bench` and
`make bench-load` wrote them), each row with a bar chart of our figure against its
baseline, drawn as inline SVG (no script, no request); `<!-- bench:goals -->` becomes
the goals table (each goal figure, quiet and `--load`: `bench.summary.goals_table`, as the
README shows it), `<!-- bench:cluster -->` the cluster figures of the quiet run
(`bench.summary.cluster_table`) and `<!-- bench:routes -->` the list of every route a
step's call can take with the row that measures it. A missing results file is an
error, so the site never shows stale or empty figures silently.
"""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results import BenchResults, Row, table_cells  # noqa: E402
from bench.summary import ROUTES, cluster_table, goals_table, load_saved  # noqa: E402

FILES = {"quiet": "bench/results.json", "load": "bench/results-load.json"}


def _rows(kind: str) -> tuple[list[Row], dict[str, Any]]:
    data = json.loads((ROOT / FILES[kind]).read_text())
    return [Row.model_validate(r) for r in data["rows"]], data


def bar(row: Row) -> str:
    """Two bars, ours over the baseline, scaled to the larger of the two."""
    if row.ours is None or row.baseline is None or max(row.ours, row.baseline) <= 0:
        return ""
    top = max(row.ours, row.baseline)
    width = 120
    ours = max(1, round(width * row.ours / top))
    base = max(1, round(width * row.baseline / top))
    colour = (
        {True: "#2e7d32", False: "#c62828"}.get(row.met, "#546e7a")
        if row.met is not None
        else "#546e7a"
    )
    label = html.escape(f"ours {row.ours:g} {row.unit}, baseline {row.baseline:g} {row.unit}")
    return (
        f'<svg class="bench-bar" width="{width}" height="14" role="img" aria-label="{label}">'
        f'<rect x="0" y="0" width="{ours}" height="6" fill="{colour}"/>'
        f'<rect x="0" y="8" width="{base}" height="6" fill="#90a4ae"/></svg>'
    )


def table(kind: str) -> str:
    rows, data = _rows(kind)
    host = data.get("host", {})
    load = host.get("loadavg_at_start", ["?"])[0]
    head = (
        f"Run of {data.get('started_at', '?')[:16].replace('T', ' ')} UTC: {host.get('cpus', '?')} "
        f"CPUs, Docker {host.get('docker', '?')}, load average {load} at the start, "
        f"{data.get('duration_s', 0):.0f} s (`{FILES[kind]}`). Bars: ours (coloured: green "
        "met, red not met, grey no goal) over the baseline (grey)."
    )
    out = [
        head,
        "",
        "| figure | ours | baseline | ratio | goal | met? | chart |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [c.replace("|", "\\|") for c in table_cells(row)]
        out.append("| " + " | ".join(cells) + f" | {bar(row)} |")
    return "\n".join(out)


def _results(kind: str) -> BenchResults:
    return load_saved(ROOT / FILES[kind])


def goals() -> str:
    return goals_table(_results("quiet"), _results("load"))


def routes() -> str:
    rows = {r.key: r for r in _results("quiet").rows}
    return "\n".join(
        f"- {route}: {rows[key].figure if key in rows else 'not in the saved run'}"
        f" ({rows[key].baseline_name if key in rows else '-'})"
        for route, key in ROUTES.items()
    )


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if "<!-- bench:" not in markdown:
        return markdown
    return (
        markdown.replace("<!-- bench:quiet -->", table("quiet"))
        .replace("<!-- bench:load -->", table("load"))
        .replace("<!-- bench:goals -->", goals())
        .replace("<!-- bench:routes -->", routes())
        .replace("<!-- bench:cluster -->", cluster_table(_results("quiet")))
    )
