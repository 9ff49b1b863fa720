"""A run's record from its first write to its last: `new_record` (`running`, written as
soon as the run folder exists), `judged` (the status the collected facts mean) and
`finish` (the final write, with the time it took).

The record names the runner that owns the run (`runner_info`), so `sandbox gc` can tell
a live run from one whose runner died and end its record `killed`.
"""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime
from pathlib import Path

from sandbox.backends import Backend
from sandbox.collect.guarding import Guarded
from sandbox.collect.harvest import Collected
from sandbox.contracts.config import StepRuntime
from sandbox.contracts.layout import RunLayout
from sandbox.contracts.record import RunnerInfo, RunStatus, TestRunRecord, write_record
from sandbox.contracts.version import runner_version
from sandbox.hostfs.procstart import process_start, start_identity
from sandbox.prepare.contenthash import content_hash
from sandbox.prepare.inputs import StepInputs
from sandbox.prepare.plan import RunPlan, images_of
from sandbox.record.outcome import status_and_reason


def runner_info() -> RunnerInfo:
    """This process as a run's runner. Without its tick count or boot id (a /proc that
    hides them) it is named by its wall-clock start alone, as before they were kept."""
    pid = os.getpid()
    ticks, boot = start_identity(pid) or (None, None)
    return RunnerInfo(
        pid=pid,
        create_time=process_start(pid),
        hostname=socket.gethostname(),
        start_ticks=ticks,
        boot_id=boot,
    )


def new_record(
    backend: Backend,
    workflow_dir: Path,
    inputs: StepInputs,
    layout: RunLayout,
    step_runtime: StepRuntime,
    *,
    workflow_run_id: str | None = None,
) -> TestRunRecord:
    """The run's first record (`running`); the images it needs must exist."""
    workflow, step = inputs.workflow, inputs.step
    backend.require_step_runtime(step_runtime)
    used_images = {
        role: backend.require_image(image) for role, image in images_of(workflow).items()
    }
    return TestRunRecord(
        runner_version=runner_version(),
        id=layout.run_id,
        workflow_run_id=workflow_run_id,
        workflow_dir=str(workflow_dir),
        workflow_name=workflow.name,
        step_id=step.id,
        group=step.group,
        command=step.display_command(),
        status=RunStatus.RUNNING,
        started_at=datetime.now(UTC),
        runner=runner_info(),
        images=used_images,
        content=content_hash(workflow_dir, workflow, step, used_images),
        backend=backend.kind,
    )


def judged(
    record: TestRunRecord, plan: RunPlan, guarded: Guarded, collected: Collected
) -> tuple[RunStatus, str]:
    """The run's status and reason from what the collect phase gathered."""
    limits = plan.workflow.limits
    return status_and_reason(
        guarded.exit_code,
        guarded.timeout_s,
        collected.guard_running,
        collected.guard_exit,
        collected.actions,
        preflight=record.preflight,
        quota_mb=limits.disk_quota_mb if collected.disk_full else None,
        oom_mb=limits.memory_mb if collected.oom_killed else None,
        landlock=record.landlock,
    )


def finish(layout: RunLayout, record: TestRunRecord, status: RunStatus, reason: str) -> None:
    """The record's final write: its status, reason, end and duration."""
    record.status = status
    record.reason = reason
    record.finished_at = datetime.now(UTC)
    record.duration_s = (record.finished_at - record.started_at).total_seconds()
    write_record(layout.root, record)
