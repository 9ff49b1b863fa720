"""The order of a test run's phases on the real engine: the step's disk and copies are
made while the engine starts the guard's container (which mounts none of them), the
record is written before any container exists, and at the end the step's files are read
while the containers go, the disk and the view unmounted once every container that mounts
them is gone (the guard's removal, which mounts neither, may still run)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import docker.errors
import pytest
from docker import DockerClient

from sandbox.backends.docker.backend import DockerBackend, DockerContainer
from sandbox.contracts.layout import DISK_MOUNT, VIEW_LAYER, WORKFLOW_VIEW
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


def test_the_guard_goes_while_the_files_are_read_and_the_disk_is_unmounted(
    engine: DockerClient, make_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's removal is held here until the step's files are being read, then
    until the step's disk is being unmounted: a run that removed the guard before
    reading the files, or waited for its removal before unmounting, would wait out a
    deadline and say so. At the unmount no container that mounts the disk or the view
    is left (the step's and the server's are gone; the guard's, held, mounts neither),
    and `execute` returns only once every one is gone."""
    reading, unmounting = threading.Event(), threading.Event()
    seen: dict[str, object] = {}
    remove_ahead, collect, close = DockerBackend.remove_ahead, StepFs.collect, StepFs.close

    def guard_held(backend: DockerBackend, container: DockerContainer) -> None:
        if container._container.labels.get(LABEL_ROLE) == "guard":
            seen["reading_when_guard_removed"] = reading.wait(SEEN_WITHIN_S)
            seen["unmounting_when_guard_removed"] = unmounting.wait(SEEN_WITHIN_S)
        remove_ahead(backend, container)

    def collect_marked(files: StepFs, *, has_db: bool) -> Collected:
        reading.set()
        return collect(files, has_db=has_db)

    def close_seeing(files: StepFs) -> None:
        if not unmounting.is_set():
            run_filter: dict[str, str | list[str] | bool] = {
                "label": f"{LABEL_RUN_ID}={files.layout.run_id}"
            }
            left = engine.containers.list(all=True, filters=run_filter, ignore_removed=True)
            seen["roles_left_at_unmount"] = sorted(str(c.labels.get(LABEL_ROLE)) for c in left)
            seen["mounts_left_at_unmount"] = [
                m["Source"] for c in left for m in c.attrs.get("Mounts") or []
            ]
            unmounting.set()
        close(files)

    monkeypatch.setattr(DockerBackend, "remove_ahead", guard_held)
    monkeypatch.setattr(StepFs, "collect", collect_marked)
    monkeypatch.setattr(StepFs, "close", close_seeing)
    server = '[[mcp_servers]]\nname = "time"\ncommand = ["mcp-server-time"]\n'
    wf = make_workflow(command="true", extra_toml=server)
    record = TestRun(Path(wf), "step1").execute()
    assert record.status is RunStatus.PASSED, record.reason
    assert seen["reading_when_guard_removed"] is True
    assert seen["unmounting_when_guard_removed"] is True
    assert seen["roles_left_at_unmount"] == ["guard"]
    # The guard's mounts: its log and its data folder in the run folder, never the disk
    # nor the view.
    sources = seen["mounts_left_at_unmount"]
    assert isinstance(sources, list) and sources
    for source in sources:
        parts = Path(source).parts
        assert record.id in parts
        assert not {DISK_MOUNT, WORKFLOW_VIEW, VIEW_LAYER} & set(parts), source
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


def test_a_step_whose_removal_failed_ends_the_run_with_nothing_left(
    engine: DockerClient, make_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's container is not removed ahead (the engine says no): the guard's
    removal and the server's still run, the log is sealed, the run ends in error with
    the engine's words, and its clean-up removes what is left before the disk is
    unmounted: no container and no mount of the run is left."""
    remove_ahead = DockerBackend.remove_ahead
    refused: list[str] = []

    def step_refused(backend: DockerBackend, container: DockerContainer) -> None:
        role = str(container._container.labels.get(LABEL_ROLE))
        if role == "step" and not refused:
            refused.append(role)
            raise docker.errors.APIError("the engine would not remove it")
        remove_ahead(backend, container)

    monkeypatch.setattr(DockerBackend, "remove_ahead", step_refused)
    server = '[[mcp_servers]]\nname = "time"\ncommand = ["mcp-server-time"]\n'
    wf = make_workflow(command="true", extra_toml=server)
    record = TestRun(Path(wf), "step1").execute()
    assert refused == ["step"]
    assert record.status is RunStatus.ERROR
    assert "the engine would not remove it" in record.reason, record.reason
    assert record.log_synced_at is not None  # sealed before the removal's error surfaced
    assert engine.containers.list(all=True, filters={"label": f"{LABEL_RUN_ID}={record.id}"}) == []
    mounts = Path("/proc/self/mountinfo").read_text()
    assert record.id not in mounts
