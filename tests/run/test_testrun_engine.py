"""The order of a test run's phases on the real engine: the step's disk and copies are
made while the engine starts the guard's container (which mounts none of them), the
record is written before any container exists, and at the end the step's files are read
while the containers go, the disk and the view unmounted only once every one is gone."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.backends.docker.backend import DockerBackend, DockerContainer
from sandbox.contracts.names import LABEL_ROLE, LABEL_RUN_ID
from sandbox.contracts.record import RECORD_FILE, RunStatus
from sandbox.run.testrun import TestRun
from sandbox.stepfs.disk import StepDisk
from sandbox.stepfs.lifecycle import Collected, StepFs
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
            for c in engine.containers.list(
                filters={"label": f"{LABEL_RUN_ID}={run_id}"}, ignore_removed=True
            ):
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


def test_the_containers_go_while_the_files_are_read_and_before_the_disk_is_unmounted(
    engine: DockerClient, make_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The removal waits here until the step's files are being read: a run that removed
    its containers before reading them would wait out the deadline and say so. The disk
    and the view go only once no container of the run is left, and `execute` returns
    only then."""
    reading = threading.Event()
    seen: dict[str, object] = {}
    remove_all, collect, close = DockerBackend.remove_all, StepFs.collect, StepFs.close

    def remove_once_reading(backend: DockerBackend) -> None:
        seen.setdefault("reading_when_removed", reading.wait(SEEN_WITHIN_S))  # the first
        remove_all(backend)

    def collect_marked(files: StepFs, *, has_db: bool) -> Collected:
        reading.set()
        return collect(files, has_db=has_db)

    def close_counting(files: StepFs) -> None:
        run_filter: dict[str, str | list[str] | bool] = {
            "label": f"{LABEL_RUN_ID}={files.layout.run_id}"
        }
        seen.setdefault(
            "left_at_unmount",
            len(engine.containers.list(all=True, filters=run_filter, ignore_removed=True)),
        )
        close(files)

    monkeypatch.setattr(DockerBackend, "remove_all", remove_once_reading)
    monkeypatch.setattr(StepFs, "collect", collect_marked)
    monkeypatch.setattr(StepFs, "close", close_counting)
    wf = make_workflow(command="true")
    record = TestRun(Path(wf), "step1").execute()
    assert record.status is RunStatus.PASSED, record.reason
    assert seen["reading_when_removed"] is True
    assert seen["left_at_unmount"] == 0
    assert engine.containers.list(all=True, filters={"label": f"{LABEL_RUN_ID}={record.id}"}) == []


def test_the_steps_container_goes_while_the_guard_stops(
    engine: DockerClient, make_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's stop is held here until the step's container of the same run is gone:
    a run that removed the step only after the guard stopped would wait out the deadline
    and say so. The step's output is in the record all the same (read before its
    container went), and nothing of the run is left."""
    seen: dict[str, object] = {}
    stop = DockerContainer.stop

    def stop_once_the_step_is_gone(container: DockerContainer, grace_s: int = 5) -> None:
        labels = container._container.labels
        if labels.get(LABEL_ROLE) == "guard":
            run_filter: dict[str, str | list[str] | bool] = {
                "label": [f"{LABEL_RUN_ID}={labels[LABEL_RUN_ID]}", f"{LABEL_ROLE}=step"]
            }
            deadline = time.monotonic() + SEEN_WITHIN_S
            gone = False
            while not gone and time.monotonic() < deadline:
                gone = not engine.containers.list(all=True, filters=run_filter, ignore_removed=True)
                if not gone:
                    time.sleep(0.05)
            seen["step_gone_at_guard_stop"] = gone
        stop(container, grace_s)

    monkeypatch.setattr(DockerContainer, "stop", stop_once_the_step_is_gone)
    wf = make_workflow(command=["sh", "-c", "echo out; echo err >&2"])
    record = TestRun(Path(wf), "step1").execute()
    assert record.status is RunStatus.PASSED, record.reason
    assert seen["step_gone_at_guard_stop"] is True
    assert record.stdout.text == "out\n" and "err" in record.stderr.text
    assert record.preflight is not None and record.preflight.ok
    assert engine.containers.list(all=True, filters={"label": f"{LABEL_RUN_ID}={record.id}"}) == []
