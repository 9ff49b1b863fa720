"""Replay where no engine is needed: a workflow run refuses it, a source that is not a
test run with a recording is a configuration error before anything runs, and only the
source's whole, regular answers are copied in."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sandbox.contracts.errors import ConfigError
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.contracts.recording import BLOBS_DIR, INDEX_FILE, RecordingSettings, ReplaySettings
from sandbox.guard.recording import Recorder, Replay
from sandbox.prepare.replaysource import ReplaySource, copy_recording, find_source
from sandbox.run.testrun import RunOptions
from sandbox.run.workflowrun import WorkflowOptions, WorkflowRun
from tests.conftest import WorkflowFactory


def test_a_workflow_run_refuses_replay(make_workflow: WorkflowFactory) -> None:
    wf = make_workflow()
    run = WorkflowRun(wf, WorkflowOptions(step=RunOptions(replay="test-x")))
    with pytest.raises(ConfigError, match="a workflow run does not replay"):
        run.read_inputs()


def test_a_missing_or_linked_source_is_refused(
    make_workflow: WorkflowFactory, tmp_path: Path
) -> None:
    wf = make_workflow()
    with pytest.raises(ConfigError, match="no such test run"):
        find_source(wf, "test-nope", "stub")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "guard" / "recording").mkdir(parents=True)
    (wf / "runs").mkdir(exist_ok=True)
    (wf / "runs" / "test-link").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="no such test run"):
        find_source(wf, "test-link", "stub")
    with pytest.raises(ConfigError, match="not a test run with a recording"):
        copy_recording(ReplaySource(elsewhere), tmp_path / "dest", 1024)


def _source(root: Path, answers: dict[str, bytes]) -> Path:
    """A finished run folder holding a recording of `answers` (key letter -> bytes)."""
    run = root / "runs" / "test-a"
    recorder = Recorder(run / "guard" / "recording", RecordingSettings())
    (run / "guard").mkdir(parents=True)
    for letter, data in answers.items():
        tap = recorder.tap(letter * 64, "bridge", f"tool {letter}")
        tap.feed(data)
        tap.close()
    recorder.close()
    record = TestRunRecord(
        id="test-a",
        workflow_dir=str(root),
        workflow_name="wf",
        step_id="s",
        group="g",
        command="true",
        status=RunStatus.PASSED,
        started_at=datetime.now(UTC),
        no_db=True,
    )
    (run / "test_mode.json").write_text(record.model_dump_json())
    return run


def test_only_whole_regular_blobs_are_copied_and_the_index_is_named(tmp_path: Path) -> None:
    run = _source(tmp_path, {"a": b"first", "b": b"second", "c": b"third"})
    blobs = run / "guard" / "recording" / BLOBS_DIR
    (blobs / hashlib.sha256(b"second").hexdigest()).write_bytes(b"SECOND")  # forged
    third = blobs / hashlib.sha256(b"third").hexdigest()
    third.unlink()
    (tmp_path / "planted").write_bytes(b"third")
    third.symlink_to(tmp_path / "planted")  # a link, even to the right bytes
    index = (run / "guard" / "recording" / INDEX_FILE).read_bytes()

    summary = copy_recording(ReplaySource(run), tmp_path / "replay", 1024)
    assert summary.run_id == "test-a"
    assert summary.index_sha256 == hashlib.sha256(index).hexdigest()
    replay = Replay(ReplaySettings(dir=str(tmp_path / "replay")))
    assert replay.answer("a" * 64) == b"first"
    assert replay.answer("b" * 64) is None and replay.answer("c" * 64) is None
    assert len(replay) == 1
