"""A finished run is read once: every output (show, JSON, JUnit, HTML) renders the loaded object."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sandbox.contracts.record import (
    ACTIONS_FILE,
    RECORD_FILE,
)
from sandbox.contracts.status import VERIFICATION_FILE
from sandbox.verify import html
from sandbox.verify.effects import effect_lines
from sandbox.verify.finished import FinishedStep, load_run
from sandbox.verify.junit import junit_xml
from sandbox.verify.verification import write_verification
from sandbox.verify.verifystep import judge, with_implicit_status
from tests.verify.recordparts import finished_run


def test_a_finished_run_is_read_once_and_every_output_renders_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = finished_run(tmp_path / "wf" / "runs" / "test-1")
    write_verification(root, judge(FinishedStep.load(root), with_implicit_status([])))

    opened: Counter[str] = Counter()
    real_open = os.open

    def counting_open(path: Any, *args: Any, **kwargs: Any) -> int:
        opened[os.fsdecode(path)] += 1
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)
    run = load_run(root)
    assert isinstance(run, FinishedStep)
    assert opened == Counter(
        {str(root / name): 1 for name in (RECORD_FILE, ACTIONS_FILE, VERIFICATION_FILE)}
    )
    opened.clear()

    assert run.verification is not None and run.verification.passed
    show = run.record.summary_lines() + effect_lines(run.record)
    assert any("upwork_submit_proposal" in line for line in show)
    assert run.record.model_dump_json()
    assert "<testcase" in junit_xml(run.verification)
    page = html.render(run)
    assert "upwork_submit_proposal" in page and "PASS" in page
    assert opened == Counter()  # rendering read nothing again


def test_an_unreadable_verification_is_absent_never_half_read(tmp_path: Path) -> None:
    root = finished_run(tmp_path / "wf" / "runs" / "test-1")
    (root / VERIFICATION_FILE).write_text('{"passed": true')
    run = FinishedStep.load(root)
    assert run.verification is None
    assert run.verification_error.startswith(f"{VERIFICATION_FILE} unreadable")
    assert "(no verification)" in html.render(run)


def test_links_are_not_followed(tmp_path: Path) -> None:
    root = finished_run(tmp_path / "wf" / "runs" / "test-1")
    elsewhere = tmp_path / "elsewhere.jsonl"
    (root / ACTIONS_FILE).rename(elsewhere)
    (root / ACTIONS_FILE).symlink_to(elsewhere)
    assert FinishedStep.load(root).calls == []
