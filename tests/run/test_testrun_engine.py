"""The order of a test run's phases on the real engine: the step's disk and copies are
made while the engine starts the guard's container (which mounts none of them), and the
record is written before any container exists."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.contracts.names import LABEL_ROLE, LABEL_RUN_ID
from sandbox.contracts.record import RECORD_FILE, RunStatus
from sandbox.run.testrun import TestRun
from sandbox.stepfs.disk import StepDisk
from sandbox.stepfs.lifecycle import StepFs
from tests.conftest import WorkflowFactory

pytestmark = pytest.mark.engine

SEEN_WITHIN_S = 60.0


def test_the_guards_container_starts_while_the_steps_disk_is_made(
    engine: DockerClient, make_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's disk (the real one: its image made, its view mounted) is made only once
    the guard's container of the same run runs: a run that made the disk before it
    started any container would never see one here and go on without it."""
    seen: dict[str, object] = {}
    make_disk = StepFs.open

    def open_once_the_guard_runs(files: StepFs) -> StepDisk:
        run_id = files.layout.run_id
        seen["record_first"] = (files.layout.root / RECORD_FILE).is_file()
        deadline = time.monotonic() + SEEN_WITHIN_S
        while time.monotonic() < deadline and "guard" not in seen:
            for c in engine.containers.list(filters={"label": f"{LABEL_RUN_ID}={run_id}"}):
                if c.labels.get(LABEL_ROLE) == "guard":
                    seen["guard"] = c.status
            time.sleep(0.05)
        return make_disk(files)

    monkeypatch.setattr(StepFs, "open", open_once_the_guard_runs)
    wf = make_workflow(command="true")
    record = TestRun(Path(wf), "step1").execute()
    assert record.status is RunStatus.PASSED, record.reason
    assert seen.get("guard") == "running"
    assert seen["record_first"] is True  # the record is on disk before any container
