"""What the collected facts of a run mean: its status and reason, and the executor's reports.

Pure: these read what the collect phase gathered (exit code, output tails, the
action summary) and touch no engine, file or container.
"""

from __future__ import annotations

import json

from sandbox.backends import UsageWatcher
from sandbox.collect.actionsummary import ActionSummary
from sandbox.contracts.record import (
    Landlock,
    OutputTail,
    PeakMemorySource,
    Preflight,
    Resources,
    RunStatus,
    Walls,
)
from sandbox.stepside.agentworks_exec.interface import (
    LANDLOCK_MARK,
    LANDLOCK_REFUSED_EXIT,
    USAGE_MARK,
)
from sandbox.stepside.agentworks_exec.preflight import FAILED_EXIT as PREFLIGHT_FAILED_EXIT
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


def verdict(
    exit_code: int | None,
    timeout_s: float,
    guard_running: bool,
    guard_exit: int | None,
    actions: ActionSummary,
    *,
    preflight: Preflight | None,
    quota_mb: int | None,
    oom_mb: int | None = None,
    landlock: Landlock | None = None,
) -> tuple[RunStatus, str]:
    """The run's status, most telling cause first: a step that never started, a fence it
    hit, a dead guard, a refused Crew call, and only then its own exit code."""
    if preflight is not None and not preflight.ok:
        opened = "; ".join(preflight.open)
        return (
            RunStatus.ERROR,
            f"preflight found a way out open, so the step never started: {opened}",
        )
    if preflight is None and exit_code == PREFLIGHT_FAILED_EXIT:
        return RunStatus.ERROR, "the preflight failed without a report"
    # A required wall refused: not made, or made without what it had to hold (reason).
    refused = (
        landlock is not None and landlock.required and (not landlock.applied or landlock.reason)
    )
    if exit_code == LANDLOCK_REFUSED_EXIT and landlock is not None and refused:
        return RunStatus.ERROR, (
            f"the step's Landlock wall is required and could not be made as needed "
            f"({landlock.reason or 'no reason given'}), so the step never started; "
            "[backend] run_without_landlock = true in the host config accepts that"
        )
    if quota_mb is not None:
        return RunStatus.QUOTA, (
            f"the step's disk (group folder, DB copy and /tmp) reached its disk quota of "
            f"{quota_mb} MB; the step was stopped"
        )
    if exit_code is None:
        return RunStatus.TIMEOUT, f"step exceeded its timeout of {timeout_s:g} s"
    if not guard_running:
        return RunStatus.ERROR, (
            f"the guard stopped during the run (exit {guard_exit}); "
            "the step's calls after that failed closed"
        )
    if actions.fails_step:
        return RunStatus.FAILED, actions.fails_step
    if oom_mb is not None:
        return RunStatus.FAILED, (
            f"memory limit of {oom_mb} MB reached: the kernel killed the step "
            f"(exit code {exit_code})"
        )
    if exit_code != 0:
        return RunStatus.FAILED, f"step exited with code {exit_code}"
    return RunStatus.PASSED, ""
