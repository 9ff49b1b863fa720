"""Whole-workflow run: a three-step no-op chain vs the same three steps as single test runs.

The chain prepares once (one run folder, one lock, the DB copy and the group folder
carried) and runs each step's own phases; three single runs each take the lock,
copy the real DB and the earlier run. Goal: the chain costs no more than the three
runs (ratio <= 1.0). Interleaved rounds, medians, so drift hits both alike.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.common import Bench, BenchError, earlier_run, small_db
from bench.results import Goal, Row, make_row
from sandbox.contracts.record import RunStatus
from sandbox.run.testrun import TestRun
from sandbox.run.workflowrun import WorkflowRun

STEPS = ("one", "two", "three")


def _chain_workflow(wf: Path) -> Path:
    (wf / "code").mkdir(parents=True)
    steps = "".join(
        f'[[steps]]\nid = "{s}"\ngroup = "g"\ncommand = ["true"]\ntimeout_s = 120\n\n'
        for s in STEPS
    )
    (wf / "workflow.toml").write_text(f'name = "chain"\n\n{steps}')
    small_db(wf / "db" / "db.sqlite")
    earlier_run(wf, files=20, each_bytes=4096)
    return wf


def bench_chain(b: Bench) -> list[Row]:
    wf = _chain_workflow(b.work / "chain")
    n = max(3, b.sizes.startup_n // 2)

    def chain() -> float:
        t = time.perf_counter()
        record = WorkflowRun(wf).execute()
        wall = time.perf_counter() - t
        if record.status is not RunStatus.PASSED:
            raise BenchError(f"no-op chain ended {record.status.value}: {record.reason}")
        return wall

    def singles() -> float:
        t = time.perf_counter()
        for step in STEPS:
            record = TestRun(wf, step).execute()
            if record.status is not RunStatus.PASSED:
                raise BenchError(f"no-op run ended {record.status.value}: {record.reason}")
        return time.perf_counter() - t

    b.say("chain: warm-up (one of each, not counted)")
    chain()
    singles()
    chains: list[float] = []
    alone: list[float] = []
    for i in range(n):
        b.say(f"chain: round {i + 1}/{n}")
        chains.append(chain())
        alone.append(singles())
    return [
        make_row(
            "chain",
            "3-step no-op chain vs 3 single test runs",
            "s",
            statistics.median(chains),
            statistics.median(alone),
            Goal(kind="ratio_max", threshold=1.0, text="<= 1.0x"),
            baseline_name="3 single runs",
            note=f"median of {n}; with a small DB and an earlier run to copy",
        )
    ]
