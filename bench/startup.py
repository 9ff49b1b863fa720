"""Start-up: a no-op step's whole test run vs one bare `docker run --rm` of the step
image through the same engine (both via the Docker SDK)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench.common import (
    BENCH_LABEL,
    STARTUP_MCP_CALL,
    Bench,
    BenchError,
    earlier_run,
    small_db,
    write_workflow,
)
from bench.mcp import MCP_SERVER
from bench.results import Goal, PhaseBreakdown, Row, StartupDetail, make_row
from sandbox.contracts.names import STEP_IMAGE
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.run.testrun import TestRun


def bench_startup(b: Bench) -> list[Row]:
    n = b.sizes.startup_n
    detail = StartupDetail(n=n)
    b.results.startup = detail
    noop = write_workflow(b.work / "startup-noop", name="noop", step="noop", command=["true"])
    with_db = write_workflow(b.work / "startup-db", name="withdb", step="noop", command=["true"])
    small_db(with_db / "db" / "db.sqlite")
    earlier_run(with_db, files=20, each_bytes=4096)
    server = f'[[mcp_servers]]\nname = "time"\ncommand = {json.dumps(MCP_SERVER)}\n'
    with_mcp = write_workflow(
        b.work / "startup-mcp", name="withmcp", step="noop", command=["true"], extra_toml=server
    )
    mcp_call = write_workflow(
        b.work / "startup-mcp-call",
        name="mcpcall",
        step="noop",
        command=["python3", "/workflow/code/call.py"],
        extra_toml=server,
        code={"call.py": STARTUP_MCP_CALL},
    )

    def bare() -> float:
        t = time.perf_counter()
        b.client.containers.run(STEP_IMAGE, ["true"], remove=True, labels={BENCH_LABEL: b.bench_id})
        return time.perf_counter() - t

    def test_run(wf: Path) -> tuple[float, TestRunRecord]:
        t = time.perf_counter()
        record = TestRun(wf, "noop").execute()
        wall = time.perf_counter() - t
        if record.status is not RunStatus.PASSED:
            raise BenchError(f"no-op test run ended {record.status.value}: {record.reason}")
        return wall, record

    b.say("start-up: warm-up (one of each, not counted)")
    bare()
    test_run(noop)
    test_run(with_db)
    test_run(with_mcp)
    test_run(mcp_call)
    runs: list[tuple[float, TestRunRecord]] = []
    db_runs: list[tuple[float, TestRunRecord]] = []
    for i in range(n):  # interleaved, so drift on the machine hits all alike
        b.say(f"start-up: round {i + 1}/{n}")
        detail.bare_s.append(round(bare(), 4))
        runs.append(test_run(noop))
        db_runs.append(test_run(with_db))
        detail.with_mcp_s.append(round(test_run(with_mcp)[0], 4))
        detail.mcp_call_s.append(round(test_run(mcp_call)[0], 4))
    detail.noop_s = [round(w, 4) for w, _ in runs]
    detail.with_db_s = [round(w, 4) for w, _ in db_runs]
    mid = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    detail.noop_median = PhaseBreakdown.of(mid[1], mid[0])
    mid_db = sorted(db_runs, key=lambda r: r[0])[len(db_runs) // 2]
    detail.with_db_median = PhaseBreakdown.of(mid_db[1], mid_db[0])
    bare_med = statistics.median(detail.bare_s)
    b.note(f"start-up, median no-op run: {detail.noop_median.text()}")
    b.note(
        f"start-up, median run with a 100-row DB and a 20-file tree: {detail.with_db_median.text()}"
    )
    return [
        make_row(
            "startup",
            "start-up: no-op step, whole test run",
            "s",
            statistics.median(detail.noop_s),
            bare_med,
            Goal(kind="ratio_max", threshold=2.0, text="<= 2x"),
            baseline_name="docker run --rm",
            note=f"median of {n}",
        ),
        make_row(
            "startup_db",
            "start-up: no-op step + small DB + tree",
            "s",
            statistics.median(detail.with_db_s),
            bare_med,
            baseline_name="docker run --rm",
            note="information: the fixed cost a workflow with a DB pays",
        ),
        make_row(
            "startup_mcp",
            "start-up: no-op step + one stdio MCP server",
            "s",
            statistics.median(detail.with_mcp_s),
            statistics.median(detail.noop_s),
            baseline_name="no-op run without it",
            note="information: the server's own container, started beside the guard",
        ),
        make_row(
            "startup_mcp_call",
            "start-up: step making one MCP call",
            "s",
            statistics.median(detail.mcp_call_s),
            statistics.median(detail.noop_s),
            baseline_name="no-op run without a server",
            note="information: up to the server's first answer, through the guard",
        ),
    ]
