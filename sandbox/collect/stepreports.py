"""The executor's reports in the step's stderr: its preflight, its Landlock wall and its
resource use, read into the record's fields and taken out of the step's own output.

Pure: each reads an output tail the engine kept; a report that does not parse is
said so in its field, never trusted.
"""

from __future__ import annotations

import json

from sandbox.backends import UsageWatcher
from sandbox.contracts.record import (
    Landlock,
    OutputTail,
    PeakMemorySource,
    Preflight,
    Resources,
    Walls,
)
from sandbox.stepside.agentworks_exec.interface import LANDLOCK_MARK, USAGE_MARK
from sandbox.stepside.agentworks_exec.preflight import MARK_FAILED as PREFLIGHT_FAILED
from sandbox.stepside.agentworks_exec.preflight import MARK_OK as PREFLIGHT_OK


def preflight_from(stderr: str, firewall_verified: bool) -> Preflight | None:
    """The executor's preflight report: the first stderr line, before the step's own."""
    for line in stderr.splitlines()[:5]:
        marker, _, payload = line.partition(" ")
        if marker in (PREFLIGHT_OK, PREFLIGHT_FAILED):
            try:
                report = Preflight.model_validate_json(payload)
            except ValueError:
                return Preflight(ok=False, open=["unreadable preflight report"])
            # The guard's entry script read the rules back before this container started.
            return report.model_copy(update={"firewall_verified": firewall_verified})
    return None


def landlock_from(stderr: str) -> Landlock:
    """The executor's Landlock report: among the first stderr lines, before the step's."""
    for line in stderr.splitlines()[:5]:
        marker, _, payload = line.partition(" ")
        if marker == LANDLOCK_MARK:
            try:
                return Landlock.model_validate_json(payload)
            except ValueError:
                return Landlock(reason="unreadable Landlock report")
    return Landlock()


def judge_walls(walls: Walls, preflight: Preflight | None, landlock: Landlock) -> Walls:
    """The run's walls with `full` and `lacking` filled in (see `Walls`)."""
    lacking = []
    if not walls.firewall:
        lacking.append("no firewall (it was turned off for this run)")
    if preflight is None or not preflight.ok:
        lacking.append("no preflight that found every way out closed")
    if not walls.seccomp:
        lacking.append("no seccomp profile")
    if landlock.required and (not landlock.applied or landlock.reason):
        lacking.append("its required Landlock wall was not made")
    if walls.egress_additions:
        lacking.append(
            "egress allow list extended for this run: " + ", ".join(walls.egress_additions)
        )
    return walls.model_copy(update={"full": not lacking, "lacking": lacking})


def resources(usage: UsageWatcher, stderr: str, *, executor_sees_memory: bool) -> Resources:
    """Peak memory and CPU: the largest peak among the sources trusted, and which it was.

    The executor's final report (its rusage, and its container's own cgroup peak read
    once the step ended) counts only when `executor_sees_memory`: under gVisor the
    container's cgroup is not visible inside, and the rusage is the sentry's account of
    processes the step controls, so the peak comes from the engine alone (the host's
    read of the container's cgroup, or the engine's samples). CPU: the executor's
    report, else the engine's samples."""
    peak, cpu = usage.peak_memory_bytes, usage.cpu_seconds
    source: PeakMemorySource | None = usage.peak_memory_source if peak else None
    for line in reversed(stderr.splitlines()[-5:]):
        marker, _, payload = line.partition(" ")
        if marker == USAGE_MARK:
            try:
                report = json.loads(payload)
                reported_cpu = float(report["cpu_seconds"])
                rss = int(report["max_rss_bytes"])
                cgroup = int(report.get("cgroup_peak_bytes", 0))
            except (ValueError, KeyError, TypeError):
                break
            cpu = reported_cpu
            executor: tuple[tuple[int, PeakMemorySource], ...] = (
                (cgroup, "container_cgroup"),
                (rss, "executor_rusage"),
            )
            for figure, name in executor if executor_sees_memory else ():
                if figure > (peak or 0):
                    peak, source = figure, name
            break
    return Resources(peak_memory_bytes=peak or None, peak_memory_source=source, cpu_seconds=cpu)


def without_reports(tail: OutputTail) -> OutputTail:
    """The step's own stderr: the executor's report lines live in their own fields."""
    markers = (PREFLIGHT_OK, PREFLIGHT_FAILED, LANDLOCK_MARK, USAGE_MARK)
    kept = [ln for ln in tail.text.splitlines(keepends=True) if not ln.startswith(markers)]
    return tail.model_copy(update={"text": "".join(kept)})
