"""Start-up: a no-op step's whole test run against what the engine itself costs.

Baselines, each through the same engine and the Docker SDK, interleaved with the runs:
one bare `docker run --rm` of the step image, and the raw two-container pod shape
(`pod_shape`: the run's shape without sandbox). `sandbox run` as a subprocess (what a
controller calls) is measured against `execute_step` in the bench's warm process.
"""

from __future__ import annotations

import compileall
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import docker.errors

import sandbox
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
from sandbox.contracts.names import GUARD_IMAGE, STEP_IMAGE
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.run.testrun import TestRun, execute_step


def pod_shape(b: Bench) -> float:
    """The test run's container shape without sandbox, timed from the first create to the
    last removal: a first container of the guard image in a network namespace of its own
    (loopback only, as a run's guard without upstream networks) running a program that
    stays up, a second of the step image joined to that namespace running `true`; the
    second's exit waited for, both removed (the second first, as a run does)."""
    labels = {BENCH_LABEL: b.bench_id}
    t = time.perf_counter()
    first = b.client.containers.create(
        GUARD_IMAGE, ["infinity"], entrypoint=["sleep"], network_mode="none", labels=labels
    )
    try:
        second = b.client.containers.create(
            STEP_IMAGE, ["true"], network_mode=f"container:{first.id}", labels=labels
        )
        try:
            first.start()
            second.start()
            code = second.wait(timeout=120).get("StatusCode")
        finally:
            with contextlib.suppress(docker.errors.NotFound):
                second.remove(force=True)
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            first.remove(force=True)
    elapsed = time.perf_counter() - t
    if code != 0:
        raise BenchError(f"the pod shape's second container exited {code}")
    return elapsed


def sandbox_command() -> list[str]:
    """The `sandbox` console script beside this interpreter (what a controller runs)."""
    script = Path(sys.executable).with_name("sandbox")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "sandbox.cli"]


def cache_bytecode() -> str:
    """Compile the package's modules to bytecode beside them, as installing it does (pip
    compiles a wheel's modules at install), so each `sandbox run` reads bytecode as a
    controller's installed CLI does; modules already compiled and current are skipped.

    Without it a checkout's CLI compiled its whole package from source at every start when
    the environment sets PYTHONDONTWRITEBYTECODE (this bench host's shells do): some 60
    modules, about 65 ms of CPU per process, never written back, that the warm process
    compiled once. Returns the row note's words on how the CLI found its modules."""
    package = Path(sandbox.__file__).parent
    ok = compileall.compile_dir(str(package), quiet=2)
    return (
        "bytecode compiled beforehand, as an install has it"
        if ok
        else (f"bytecode could not be written under {package}: each start compiles the sources")
    )


def cli_run(wf: Path, step: str) -> float:
    """`sandbox run WF STEP --json` as a new process, to its exit; it must pass."""
    t = time.perf_counter()
    done = subprocess.run(
        [*sandbox_command(), "run", str(wf), step, "--json"],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        check=False,
        timeout=300,
    )
    elapsed = time.perf_counter() - t
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise BenchError(f"`sandbox run` exited {done.returncode}: {tail[:300]}")
    return elapsed


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

    def warm_api(wf: Path) -> tuple[float, TestRunRecord]:
        """The public API, in this process whose imports and engine client are warm."""
        t = time.perf_counter()
        record = execute_step(wf, "noop", test_mode=True)
        wall = time.perf_counter() - t
        if record.status is not RunStatus.PASSED:
            raise BenchError(f"no-op test run ended {record.status.value}: {record.reason}")
        return wall, record

    bytecode = cache_bytecode()
    b.say("start-up: warm-up (one of each, not counted)")
    bare()
    pod_shape(b)
    warm_api(noop)
    cli_run(noop, "noop")
    test_run(with_db)
    test_run(with_mcp)
    test_run(mcp_call)
    runs: list[tuple[float, TestRunRecord]] = []
    db_runs: list[tuple[float, TestRunRecord]] = []
    for i in range(n):  # interleaved, so drift on the machine hits all alike
        b.say(f"start-up: round {i + 1}/{n}")
        detail.bare_s.append(round(bare(), 4))
        detail.pod_shape_s.append(round(pod_shape(b), 4))
        runs.append(warm_api(noop))
        detail.cli_s.append(round(cli_run(noop, "noop"), 4))
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
    noop_med = statistics.median(detail.noop_s)
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
            "startup_pod",
            "start-up: no-op test run vs the raw pod shape",
            "s",
            noop_med,
            statistics.median(detail.pod_shape_s),
            Goal(kind="ratio_max", threshold=1.3, text="<= 1.3x"),
            baseline_name="two containers, shared netns",
            note=(
                f"median of {n}; the same two containers (guard image up, step image running"
                " `true` in its network namespace) created, run and removed through the SDK"
            ),
        ),
        make_row(
            "startup_cli_bare",
            "start-up: no-op `sandbox run` (CLI, a new process) vs bare docker run",
            "s",
            statistics.median(detail.cli_s),
            bare_med,
            Goal(kind="ratio_max", threshold=1.6, text="<= 1.6x"),
            baseline_name="docker run --rm",
            note=(
                f"median of {n}; what a controller pays per run: the CLI's start-up, the"
                " guard and step containers, the record, against one container of the step"
                " image run and removed"
            ),
        ),
        make_row(
            "startup_cli",
            "start-up: `sandbox run` (a new process) vs execute_step",
            "s",
            statistics.median(detail.cli_s),
            noop_med,
            Goal(kind="ratio_max", threshold=1.15, text="<= 1.15x"),
            baseline_name="execute_step, warm process",
            note=(
                f"median of {n}; the CLI's interpreter start-up, imports and engine"
                f" connection against the same run in a process that has them; {bytecode}"
            ),
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
            noop_med,
            baseline_name="no-op run without it",
            note="information: the server's own container, started beside the guard",
        ),
        make_row(
            "startup_mcp_call",
            "start-up: step making one MCP call",
            "s",
            statistics.median(detail.mcp_call_s),
            noop_med,
            baseline_name="no-op run without a server",
            note="information: up to the server's first answer, through the guard",
        ),
    ]
