"""What the collected facts of a run mean: its status and the reason for it.

Pure: it reads what the collect phase gathered (exit code, the executor's reports,
the action summary) and touches no engine, file or container.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sandbox.contracts.record import Landlock, Preflight, RunStatus
from sandbox.stepside.agentworks_exec.interface import LANDLOCK_REFUSED_EXIT
from sandbox.stepside.agentworks_exec.preflight import FAILED_EXIT as PREFLIGHT_FAILED_EXIT

if TYPE_CHECKING:
    from sandbox.collect.actionsummary import ActionSummary


def status_and_reason(
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
