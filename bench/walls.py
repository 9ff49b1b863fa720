"""Start-up with each second wall against the plain runc run, as ratios (`--only walls`).

The host's engine is never reconfigured: the bench starts two private engines of its
own (`testbed/engines/second_engine.py`: own socket, data-root, exec-root, no bridge or
iptables, stopped by pid, the host's engine checked afterwards), one with gVisor's
runsc registered as the run needs it and one with userns-remap, and loads the run
images into them. Then, interleaved so drift on the machine hits all alike, a no-op
test run:

- plain: the step on runc, in the runsc engine (the baseline);
- gVisor: the step on runsc (`--step-runtime runsc`), same engine, guard on runc;
- userns-remap: the step and guard on runc in the remapped engine.

Each figure is the median wall time of the whole test run; the ratio is against the
plain run's median. Needs root and runsc (installed by `scripts/ensure-runsc.sh`).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from bench.common import Bench, BenchError, write_workflow
from bench.results import Goal, Row, make_row
from sandbox.contracts.config import StepRuntime
from sandbox.contracts.record import RunStatus
from sandbox.run.testrun import RunOptions, TestRun
from testbed.engines.engine_config import RUN_IMAGES, EngineConfig
from testbed.engines.second_engine import SecondEngine

# The README's start-up figure for the step under gVisor (measured here: 1.5-1.8x).
RUNSC_GOAL = Goal(kind="ratio_max", threshold=2.5, text="<= 2.5x")
USERNS_GOAL = Goal(kind="ratio_max", threshold=1.3, text="<= 1.3x")


@contextlib.contextmanager
def _docker_host(url: str) -> Iterator[None]:
    saved = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = url
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved


def _timed_run(engine: SecondEngine, wf: Path, runtime: StepRuntime) -> float:
    with _docker_host(engine.url):
        t = time.perf_counter()
        record = TestRun(wf, "noop", RunOptions(step_runtime=runtime)).execute()
        wall = time.perf_counter() - t
    if record.status is not RunStatus.PASSED:
        raise BenchError(f"no-op run ({runtime}) ended {record.status.value}: {record.reason}")
    return wall


def bench_walls(b: Bench) -> list[Row]:
    n = b.sizes.startup_n
    wf = write_workflow(b.work / "walls-noop", name="noop", step="noop", command=["true"])
    b.say("walls: starting a runsc engine and a userns-remap engine, loading the images")
    with contextlib.ExitStack() as stack:
        runsc = SecondEngine.start(EngineConfig.runsc(), images=RUN_IMAGES, share=(b.work,))
        stack.callback(runsc.stop)
        userns = SecondEngine.start(EngineConfig.userns(), images=RUN_IMAGES, share=(b.work,))
        stack.callback(userns.stop)
        kinds: dict[str, tuple[SecondEngine, StepRuntime]] = {
            "plain": (runsc, "runc"),
            "runsc": (runsc, "runsc"),
            "userns": (userns, "runc"),
        }
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for engine, runtime in kinds.values():  # warm-up, not counted
            _timed_run(engine, wf, runtime)
        for i in range(n):
            b.say(f"walls: round {i + 1}/{n}")
            for kind, (engine, runtime) in kinds.items():
                times[kind].append(_timed_run(engine, wf, runtime))
    med = {k: statistics.median(v) for k, v in times.items()}
    b.note(
        "walls, medians of a no-op test run: "
        + ", ".join(f"{k} {v:.3f} s" for k, v in med.items())
        + f" (n={n}, interleaved, in private engines)"
    )
    return [
        make_row(
            "walls",
            "start-up: no-op run, step under gVisor (runsc)",
            "s",
            med["runsc"],
            med["plain"],
            RUNSC_GOAL,
            baseline_name="same run, step on runc",
        ),
        make_row(
            "walls",
            "start-up: no-op run, userns-remap engine",
            "s",
            med["userns"],
            med["plain"],
            USERNS_GOAL,
            baseline_name="same run, no remap",
        ),
    ]
