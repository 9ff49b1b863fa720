"""`sandbox bench` (`make bench`): how fast test mode is, every figure against a baseline.

Each figure is measured against a baseline taken in the same run, on the same
machine, interleaved with it where that is possible, because these machines
are noisy: the ratio is what a change is judged by; absolute times are printed
too. One table goes to stdout, progress to stderr, and the full results (every
sample, the phase breakdown, the host) to `bench/results.json`.

Benchmarks, one module each (see the README's Performance section for what each
goal means): `startup`, `treecopy`, `dbcopy`, `guard`, `executor`, `scale`, `mcp`,
`egress`, `walls`, `chain`, and `kubernetes` only when named (`--only kubernetes`: it
needs a cluster; its rows join the saved `bench/results.json`, and a full run keeps
the last ones); `results` is the arithmetic and the table, `common` what they share,
and `programs/` the client programs they run inside containers. Peers run in
the same benchmark as the guard: Squid and tinyproxy (`peers`, in containers built
here) for egress, the log's sync alone for the guard. `--load` runs the same
figures with a CPU hog and a disk hog beside them (`load`), into
`bench/results-load.json`. `summary` names the row of every route a step's call
can take and renders the goals table the README shows (`--readme` rewrites it).

Nothing here is part of `make test`: speed targets live here, not in tests.
Everything the bench creates (a temp dir, containers labelled `sandbox.bench`,
the fake upstreams) is removed before it returns.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import psutil
from docker import DockerClient

from bench.common import MIB, QUICK, Bench, Sizes
from bench.dbcopy import bench_db
from bench.egress import bench_egress
from bench.executor import bench_executor
from bench.guard import bench_guard
from bench.load import hogs
from bench.mcp import bench_mcp
from bench.results import BenchResults, HostInfo, Row, format_table, status_row
from bench.scale import bench_scale
from bench.startup import bench_startup
from bench.summary import (
    CLUSTER_ROWS,
    ON_REQUEST_NOTE,
    load_saved,
    readme_block,
    replace_block,
)
from bench.treecopy import bench_copy
from sandbox.backends.docker.client import connect
from sandbox.backends.docker.images import REPO_ROOT

RESULTS_PATH = REPO_ROOT / "bench" / "results.json"
LOAD_RESULTS_PATH = REPO_ROOT / "bench" / "results-load.json"  # a full run with --load


ALL_BENCHMARKS = (
    "startup",
    "copy",
    "db",
    "guard",
    "exec",
    "scale",
    "mcp",
    "egress",
    "walls",
    "chain",
)
# Only when named (`--only kubernetes`): it needs a cluster, the host config's or the
# local test cluster it starts for the duration.
ON_REQUEST = ("kubernetes",)


BENCHMARKS: dict[str, tuple[str, Callable[[Bench], list[Row]]]] = {
    "startup": ("start-up", bench_startup),
    "copy": ("copy", bench_copy),
    "db": ("db copy", bench_db),
    "guard": ("guard", bench_guard),
    "exec": ("executor route", bench_executor),
    "scale": ("scale", bench_scale),
    "mcp": ("mcp", bench_mcp),
    "egress": ("egress", bench_egress),
    "walls": ("second walls", lambda b: _walls(b)),
    "chain": ("whole-workflow chain", lambda b: _chain(b)),
    "kubernetes": ("start-up on a cluster", lambda b: _kubernetes(b)),
}


def _kubernetes(b: Bench) -> list[Row]:
    """A no-op run as a Pod against a bare Pod on the same cluster (bench/kubernetes.py)."""
    from bench.kubernetes import bench_kubernetes

    return bench_kubernetes(b)


def _chain(b: Bench) -> list[Row]:
    """A three-step no-op chain against the same steps as single test runs (bench/chain.py)."""
    from bench.chain import bench_chain

    return bench_chain(b)


def _walls(b: Bench) -> list[Row]:
    """The second walls' start-up (bench/walls.py: it starts engines of its own)."""
    from bench.walls import bench_walls

    return bench_walls(b)


def on_request_note(results: BenchResults) -> str:
    """When and under what load the rows of an on-request run were measured."""
    load = results.host.loadavg_at_start[0]
    return (
        f"{ON_REQUEST_NOTE} {results.started_at:%Y-%m-%d %H:%M} UTC"
        f" (load average {load:.1f} on {results.host.cpus} CPUs at its start)"
    )


def with_rows(saved: BenchResults, rows: list[Row], note: str = "") -> BenchResults:
    """`saved` with `rows` in place of its rows of the same keys (and `note` in place of
    an earlier on-request run's)."""
    keys = {row.key for row in rows}
    notes = [n for n in saved.notes if not n.startswith(ON_REQUEST_NOTE)]
    return saved.model_copy(
        update={
            "rows": [r for r in saved.rows if r.key not in keys] + rows,
            "notes": notes + ([note] if note else []),
        }
    )


def cluster_rows(saved: BenchResults, results: BenchResults) -> list[Row]:
    """The saved cluster figures (`summary.CLUSTER_ROWS`) a full run did not measure: a
    plain `make bench` starts no cluster, and keeps the last `make bench-kubernetes`'s."""
    measured = {row.key for row in results.rows}
    return [r for r in saved.rows if r.key in CLUSTER_ROWS and r.key not in measured]


def host_info(client: DockerClient) -> HostInfo:
    version = str(client.version().get("Version", "?"))
    load = os.getloadavg()
    return HostInfo(
        cpus=os.cpu_count() or 0,
        memory_mb=psutil.virtual_memory().total // MIB,
        kernel=platform.release(),
        python=platform.python_version(),
        docker=version,
        loadavg_at_start=(round(load[0], 2), round(load[1], 2), round(load[2], 2)),
        foreign_containers_at_start=len(client.api.containers()),
    )


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A private scratch folder on the same file system as the runs' default place."""
    base = Path("/var/tmp") if Path("/var/tmp").is_dir() else Path(tempfile.gettempdir())
    path = Path(tempfile.mkdtemp(prefix="sandbox-bench-", dir=base))
    path.chmod(0o755)  # the step and guard uids read workflow files below it
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run(selected: list[str], sizes: Sizes, *, load: bool = False) -> BenchResults:
    """Run the selected benchmarks; `load`: with the CPU and disk hogs beside them."""
    client = connect()
    results = BenchResults(started_at=datetime.now(UTC), host=host_info(client), load=load)
    started = time.monotonic()
    with scratch_dir() as work, hogs(work) if load else contextlib.nullcontext():
        bench = Bench(client, work, sizes, results)
        if load:
            bench.say("--load: a CPU hog and a disk hog run beside every benchmark")
        try:
            for key in selected:
                title, func = BENCHMARKS[key]
                bench.say(f"== {title}")
                try:
                    results.rows += func(bench)
                except Exception as exc:
                    traceback.print_exc(file=sys.stderr)
                    results.rows.append(
                        status_row(key, f"{title}: benchmark", "failed", f"{exc}"[:300])
                    )
                finally:
                    bench.cleanup()
        finally:
            bench.cleanup()
    results.duration_s = round(time.monotonic() - started, 1)
    host = results.host
    if host.foreign_containers_at_start or host.loadavg_at_start[0] > host.cpus / 2:
        results.notes.append(
            f"host was busy at start (load average {host.loadavg_at_start[0]:.1f} on"
            f" {host.cpus} CPUs, {host.foreign_containers_at_start} containers of others"
            " running): absolute figures are noisier than on an idle machine; ratios are"
            " measured interleaved to cancel most of it"
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sandbox bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated subset of: {','.join(ALL_BENCHMARKS + ON_REQUEST)} "
        f"({', '.join(ON_REQUEST)} only when named)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (developing the bench)")
    parser.add_argument(
        "--out", default=None, help=f"results JSON (default {RESULTS_PATH} for a full run)"
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print the table of the results file as markdown"
    )
    parser.add_argument(
        "--readme",
        action="store_true",
        help="rewrite the README's goals table from the saved quiet and --load results",
    )
    parser.add_argument(
        "--load",
        action="store_true",
        help="the same figures with a CPU hog and a disk hog beside them (bounded in time)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else LOAD_RESULTS_PATH if args.load else RESULTS_PATH
    if args.readme:
        readme = REPO_ROOT / "README.md"
        quiet, loaded = load_saved(RESULTS_PATH), load_saved(LOAD_RESULTS_PATH)
        readme.write_text(replace_block(readme.read_text(), readme_block(quiet, loaded)))
        print(f"rewrote the goals table in {readme}")
        return 0
    if args.markdown:
        saved = BenchResults.model_validate_json(out.read_text())
        print(format_table(saved.rows, markdown=True))
        return 0
    selected = [s.strip() for s in args.only.split(",") if s.strip()] or list(ALL_BENCHMARKS)
    unknown = [s for s in selected if s not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    sizes = QUICK if args.quick else Sizes()
    results = run(selected, sizes, load=args.load)
    results.complete = not args.quick and selected == list(ALL_BENCHMARKS)
    on_request = not args.quick and not args.out and set(selected) <= set(ON_REQUEST)
    print(format_table(results.rows))
    print()
    for row in results.rows:
        if row.note:
            print(f"- {row.figure}: {row.note}")
    for note in results.notes:
        print(f"- {note}")
    print(f"\ntotal {results.duration_s:.0f} s on {results.host.cpus} CPUs")
    if results.complete and out.is_file():
        saved_run = load_saved(out)
        kept = cluster_rows(saved_run, results)
        results.rows += kept
        if kept:
            results.notes += [n for n in saved_run.notes if n.startswith(ON_REQUEST_NOTE)]
    if on_request and out.is_file():
        # Its figures join the saved full run, whose own figures stay as they were.
        saved = BenchResults.model_validate_json(out.read_text())
        results = with_rows(saved, results.rows, note=on_request_note(results))
    if results.complete or args.out or on_request:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(results.model_dump_json(indent=2) + "\n")
        print(f"results: {out}")
    return 1 if any(r.status == "failed" for r in results.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
