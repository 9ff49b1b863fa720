"""Executor route: a DB query, a file read and a shell command start routed to the step's
executor, against a stubbed bridge call from the same step plus the tool's own work
(SQLite's query on the DB copy, the file's read, `/bin/sh -c true` started and waited
for), timed in the same step, one of each kind in turn."""

from __future__ import annotations

import json

from bench.common import Bench, BenchError, execute, program, small_db, write_workflow
from bench.results import ExecDetail, Goal, LatencyStats, Row, make_row
from sandbox.contracts.record import RunStatus
from sandbox.run.testrun import RunOptions

EXEC_STEP = program("exec_step.py")

EXEC_DESIGN = (
    "executor: one test run whose step is the client (bench/programs/exec_step.py), one "
    "keep-alive connection to its bridge: a stubbed call (notify_user, answered in the guard), "
    "query_workflow_db (10 rows of a 100-row table), read_file (40 lines) and "
    "execute_shell_command (`true`), all routed by the guard to the step's executor; in the "
    "step's own process the same query on the DB copy as the executor makes it (connect "
    "read-only, limits, query, close), the same read and the same command started and waited "
    "for. "
    "{calls} of each, one of each kind in turn (the first rotating); the floor of a routed "
    "call is the stubbed call plus the tool's own time."
)


def bench_executor(b: Bench) -> list[Row]:
    calls = b.sizes.exec_calls
    cfg = {"calls": calls, "warmup": 20}
    wf = write_workflow(
        b.work / "exec",
        name="execbench",
        step="calls",
        command=["python3", "/workflow/code/exec_step.py", json.dumps(cfg)],
        timeout_s=300,
        code={"exec_step.py": EXEC_STEP},
    )
    small_db(wf / "db" / "db.sqlite")
    b.say(f"executor: {calls} calls of each kind from one step, in turn")
    record = execute(wf, "calls", RunOptions())
    if record.status is not RunStatus.PASSED:
        tail = " | ".join(record.stderr.text.strip().splitlines()[-3:])
        raise BenchError(f"executor bench run {record.status.value}: {record.reason}: {tail}")
    try:
        printed = json.loads(record.stdout.text.strip().splitlines()[-1])
        stats = {name: LatencyStats.model_validate(value) for name, value in printed.items()}
    except (ValueError, IndexError) as exc:
        raise BenchError(f"executor bench step printed no figures: {exc}") from None
    detail = ExecDetail(
        design=EXEC_DESIGN.format(calls=calls),
        stubbed=stats["stub"],
        db_query=stats["db"],
        file_read=stats["file"],
        sqlite_alone=stats["sqlite"],
        read_alone=stats["read"],
        shell=stats["shell"],
        spawn_alone=stats["spawn"],
    )
    b.results.executor = detail
    b.note(detail.design)
    stub = detail.stubbed.median_ms
    goal = Goal(kind="added_max", threshold=1.0, text="<= stub + own time + 1 ms")
    rows = []
    assert detail.shell is not None and detail.spawn_alone is not None
    for key, label, routed, alone, what in (
        ("exec_db", "DB query", detail.db_query, detail.sqlite_alone, "SQLite"),
        ("exec_file", "file read", detail.file_read, detail.read_alone, "the read"),
        ("exec_shell", "shell command start", detail.shell, detail.spawn_alone, "the spawn"),
    ):
        rows += [
            make_row(
                key,
                f"executor: {label} via the bridge vs a stubbed call",
                "ms",
                routed.median_ms,
                stub,
                baseline_name="stubbed call",
                note=f"p99 {routed.p99_ms:.2f} ms vs {detail.stubbed.p99_ms:.2f};"
                f" {routed.n} calls each",
            ),
            make_row(
                f"{key}_floor",
                f"executor: {label} vs a stubbed call + {what} alone",
                "ms",
                routed.median_ms,
                stub + alone.median_ms,
                goal,
                baseline_name=f"stub + {what} {alone.median_ms:.2f} ms",
                note=f"added {routed.median_ms - stub - alone.median_ms:.2f} ms",
            ),
        ]
    return rows
