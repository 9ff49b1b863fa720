"""`verify --against` (the verdict and what changed since the last passing verification or
a named run) and `report --against` (the comparison as a section of the HTML report)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from sandbox.cli import main
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.exitcodes import ExitCode
from sandbox.verify import history
from sandbox.verify.against import VerifiedAgainst, check_named, verify_against
from sandbox.verify.diff import ArgumentChange
from sandbox.verify.finished import FinishedStep
from sandbox.verify.verification import Verification, write_verification
from sandbox.verify.verifystep import judge, with_implicit_status
from tests.verify.recordparts import SUBMIT, chain, finished_run


def verified(wf: Path, run_id: str, connects: int, **fields: Any) -> Verification:
    """A run of step `s` as the runner leaves it, judged, its verdict in the history."""
    submit = (SUBMIT[0], SUBMIT[1], SUBMIT[2] | {"connects": connects})
    root = finished_run(wf / "runs" / run_id, [submit], **fields)
    verification = judge(FinishedStep.load(root), with_implicit_status([]))
    write_verification(root, verification)
    history.append(wf, verification)
    return verification


def test_the_last_passing_verification_is_the_baseline(tmp_path: Path) -> None:
    wf = tmp_path / "wf"
    verified(wf, "test-1", 14)
    verified(wf, "test-2", 15)  # the last that passed before the fix
    verified(wf, "test-3", 99, exit_code=1, status="failed")  # failed: never a baseline
    now = verified(wf, "test-4", 16)
    result = verify_against(wf, now, "last-passing")
    assert result.verification == now and result.passed and result.run_id == "test-4"
    assert result.digest == now.digest
    assert result.baseline_run == "test-2" and result.comparison is not None
    assert (result.comparison.run_a, result.comparison.run_b) == ("test-2", "test-4")
    assert result.comparison.calls[0].arguments == [ArgumentChange(path="connects", a=15, b=16)]
    lines = result.lines()
    at = lines.index("what changed against test-2 (the last passing verification):")
    assert lines[:at] == now.lines()
    assert lines[at + 1 : at + 3] == ["  A: test run test-2 of s", "  B: test run test-4 of s"]
    assert lines[at + 3].startswith("  first divergence: call changed: upwork_submit_proposal")
    assert lines[at + 3].endswith("connects 15 -> 16")
    # One object for programs: the verification and the comparison.
    data = json.loads(result.model_dump_json())
    assert data["verification"]["run_id"] == "test-4"
    assert data["comparison"]["calls"][0]["arguments"][0] == {
        "path": "connects",
        "a": 15,
        "b": 16,
        "only_in": None,
    }
    assert VerifiedAgainst.model_validate(data) == result


def test_nothing_to_compare_against_is_said_and_the_verdict_stands(tmp_path: Path) -> None:
    wf = tmp_path / "wf"
    first = verified(wf, "test-1", 16)
    alone = verify_against(wf, first, "last-passing")  # its own run is never its baseline
    assert alone.passed and alone.comparison is None and alone.baseline_run is None
    assert alone.lines()[-1] == (
        "against last-passing: no passing verification of s to compare against "
        "(nothing compared; the verdict stands)"
    )
    now = verified(wf, "test-2", 17)
    shutil.rmtree(wf / "runs" / "test-1")  # `sandbox gc --remove-runs`
    gone = verify_against(wf, now, "last-passing")
    assert gone.passed and gone.comparison is None and gone.baseline_run == "test-1"
    assert gone.not_compared.startswith(
        "the last passing verification (test-1, "
    ) and gone.not_compared.endswith(
        f"cannot be compared: no test_mode.json in {wf / 'runs' / 'test-1'} (the verdict stands)"
    )


def test_a_named_run_is_the_baseline_and_is_checked_before_the_run(tmp_path: Path) -> None:
    wf = tmp_path / "wf"
    verified(wf, "test-1", 15)
    now = verified(wf, "test-2", 16)
    by_id = verify_against(wf, now, "test-1")
    by_path = verify_against(wf, now, str(wf / "runs" / "test-1"))
    assert by_id.comparison == by_path.comparison and by_id.comparison is not None
    assert "what changed against test-1 (the run named):" in by_id.lines()
    check_named(wf, "last-passing")
    check_named(wf, "test-1")
    with pytest.raises(ConfigError, match=r"no test_mode\.json"):
        check_named(wf, "test-typo")
    chain(wf, "test-chain")
    with pytest.raises(ConfigError, match="is a whole-workflow test run; give its step's run"):
        check_named(wf, "test-chain")


def test_report_against_adds_what_changed_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wf = tmp_path / "wf"
    verified(wf, "test-1", 15)
    hostile = {"connects": 16, "text": "<script>fetch('http://outside.test/')</script>"}
    root = finished_run(wf / "runs" / "test-2", [(SUBMIT[0], SUBMIT[1], SUBMIT[2] | hostile)])
    out = tmp_path / "report.html"
    args = ["report", str(root), "--html", str(out)]
    assert main([*args, "--against", str(wf / "runs" / "test-1")]) == 0
    page = out.read_text()
    assert "<h2>What changed against test-1</h2>" in page
    assert "connects 15 -&gt; 16" in page and "<script" not in page
    assert "&lt;script&gt;fetch(" in page
    assert page.index('id="verdict"') < page.index('id="against"') < page.index('id="effects"')
    assert main(args) == 0
    assert 'id="against"' not in out.read_text()
    chain_a, chain_b = chain(wf, "test-ca", 15), chain(wf, "test-cb", 16)
    assert main(["report", str(chain_b), "--html", str(out), "--against", str(chain_a)]) == 0
    page = out.read_text()
    assert "What changed against test-ca" in page
    assert "step bid-submit: call changed: upwork_submit_proposal" in page
    assert main([*args, "--against", str(chain_a)]) == ExitCode.CONFIG  # a chain vs a step
    assert "whole-workflow test run" in capsys.readouterr().err
