"""`sandbox diff` / `sandbox.compare` of two whole-workflow runs: step by step, on the reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sandbox
from sandbox.cli import main
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.exitcodes import ExitCode
from sandbox.verify.chaindiff import ChainComparison
from sandbox.verify.compare import compare
from sandbox.verify.diff import ArgumentChange
from tests.verify.recordparts import (
    PICK,
    SLACK,
    SUBMIT,
    Calls,
    chain,
    finished_chain,
    finished_run,
)


def test_a_chains_diff_names_the_step_that_changed_first(tmp_path: Path) -> None:
    wf = tmp_path / "wf"
    a, b = chain(wf, "test-a", 15), chain(wf, "test-b", 16)
    result = sandbox.compare(a, b)
    assert isinstance(result, ChainComparison) and result.kind == "workflow"
    assert not result.same and result.changed_steps == ["bid-submit"]
    submit = next(s for s in result.steps if s.step_id == "bid-submit")
    assert submit.comparison is not None and (submit.index_a, submit.index_b) == (2, 2)
    assert submit.comparison.calls[0].arguments == [ArgumentChange(path="connects", a=15, b=16)]
    assert not (result.fields or result.db or result.expectations)
    lines = result.lines()
    assert lines[:2] == [
        "A: workflow test run test-a of job-board",
        "B: workflow test run test-b of job-board",
    ]
    assert lines[2].startswith(
        "first divergence: step bid-submit: call changed: upwork_submit_proposal at A #1 / B #1"
    )
    assert lines[2].endswith(": connects 15 -> 16") and lines[3] == "1 difference(s):"
    assert compare(a, chain(wf, "test-c", 15)).same


def test_a_step_in_one_chain_only_or_skipped_in_one_is_named(tmp_path: Path) -> None:
    wf = tmp_path / "wf"
    a = chain(wf, "test-a")
    b = finished_chain(
        wf,
        "test-b",
        [("bid-pick-job", [PICK]), ("bid-submit", None), ("follow-up", [SLACK])],
    )
    result = compare(a, b)
    assert isinstance(result, ChainComparison)
    assert result.changed_steps == ["bid-submit", "outreach", "follow-up"]
    body = result.differences()
    assert body[:3] == [
        "step bid-submit: passed -> skipped (no readable run of it in B)",
        "step outreach: only in A (step 3, passed)",
        "step follow-up: only in B (step 3, passed)",
    ]
    assert body[3] == (
        'chain steps: "bid-pick-job -> bid-submit -> outreach" -> '
        '"bid-pick-job -> bid-submit -> follow-up"'
    )


def test_chain_diff_text_is_terminal_safe_json_for_programs_and_refusals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wf = tmp_path / "wf"
    text = (SLACK[0], SLACK[1], SLACK[2] | {"text": "\x1b]0;x\x07"})
    hostile: list[tuple[str, Calls | None]] = [("bid-pick-job", [PICK]), ("outreach", [text])]
    a, b = chain(wf, "test-a"), chain(wf, "test-b", steps=hostile)
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "step bid-submit: only in A" in out
    assert main(["diff", str(a), str(b), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "workflow"
    outreach = next(s for s in data["steps"] if s["step_id"] == "outreach")
    assert outreach["comparison"]["calls"][0]["arguments"][0]["path"] == "text"

    step = finished_run(wf / "runs" / "test-one", [SUBMIT])
    with pytest.raises(ConfigError, match="run B is a whole-workflow test run and run A a run"):
        compare(step, a)
    unsealed = chain(wf, "test-u", sealed=False)
    assert main(["diff", str(a), str(unsealed)]) == ExitCode.CONFIG
    assert "run B" in capsys.readouterr().err
