"""`sandbox diff` / `sandbox.compare`: two finished runs of a step compared, on the reader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import sandbox
from sandbox.cli import main
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.exitcodes import ExitCode
from sandbox.contracts.record import EgressCounts
from sandbox.contracts.reports import DbDiff, RowChange, TableDiff
from sandbox.verify.compare import compare as compare_any
from sandbox.verify.diff import ArgumentChange, RunComparison
from tests.verify.recordparts import SUBMIT, finished_run

CLICK = ("agent_browser", "stub", {"command": "click #submit"})
READ = ("query_workflow_db", "allow", {"sql": "SELECT 1"})


def submit(**args: Any) -> tuple[str, str, dict[str, Any]]:
    return (SUBMIT[0], SUBMIT[1], SUBMIT[2] | args)


def compare(a: Any, b: Any) -> RunComparison:
    """Two runs of a step compared (the typed result for one step's runs)."""
    result = compare_any(a, b)
    assert isinstance(result, RunComparison)
    return result


def two_runs(tmp_path: Path, calls_a: list[Any], calls_b: list[Any], **b_fields: Any) -> Any:
    runs = tmp_path / "wf" / "runs"
    return (
        finished_run(runs / "test-a", calls_a),
        finished_run(runs / "test-b", calls_b, **b_fields),
    )


def test_a_changed_argument_is_named_alone_and_first(tmp_path: Path) -> None:
    a, b = two_runs(tmp_path, [READ, submit(), CLICK], [READ, submit(connects=15), CLICK])
    result = sandbox.compare(a, b)
    assert isinstance(result, RunComparison) and not result.same and result.kind == "step"
    assert [c.change for c in result.calls] == ["changed"]
    changed = result.calls[0]
    assert (changed.tool, changed.position_a, changed.position_b) == (SUBMIT[0], 1, 1)
    assert changed.arguments == [ArgumentChange(path="connects", a=16, b=15)]
    assert not (result.fields or result.db or result.files or result.egress)
    lines = result.lines()
    assert lines[2] == (
        "first divergence: call changed: upwork_submit_proposal at A #1 / B #1: connects 16 -> 15"
    )
    assert lines[3] == "1 difference(s):"


def test_same_runs_have_no_difference(tmp_path: Path) -> None:
    a, b = two_runs(tmp_path, [submit(), CLICK], [submit(), CLICK])
    result = compare(a, b)
    assert result.same and result.calls == []
    assert "no difference" in result.lines()


def test_calls_added_removed_and_a_decision_changed_in_ledger_order(tmp_path: Path) -> None:
    a, b = two_runs(
        tmp_path,
        [submit(), CLICK, ("send_slack_message", "stub", {"to": "x"})],
        [("notify_user", "stub", {}), submit(), ("agent_browser", "refuse", CLICK[2])],
    )
    result = compare(a, b)
    got = [(c.change, c.tool, c.decision_a, c.decision_b) for c in result.calls]
    assert got == [
        ("added", "notify_user", None, "stub"),
        ("changed", "agent_browser", "stub", "refuse"),
        ("removed", "send_slack_message", "stub", None),
    ]
    assert result.lines()[2] == "first divergence: call added: notify_user (stub) at B #1 (line 1)"


def test_db_rows_egress_status_compared(tmp_path: Path) -> None:
    def db(text: str) -> DbDiff:
        row = RowChange(kind="inserted", key={"id": 42}, row={"id": 42, "text": text})
        table = TableDiff(name="proposals", inserted=1, rows=[row])
        return DbDiff(before="real", after="copy", tables=[table], tables_compared=1)

    runs = tmp_path / "wf" / "runs"
    a = finished_run(runs / "test-a", [], no_db=False, db_diff=db("hi"))
    b = finished_run(
        runs / "test-b",
        [],
        no_db=False,
        db_diff=db("hello"),
        exit_code=3,
        egress={"api.example": EgressCounts(stubbed=1)},
    )
    result = compare(a, b)
    assert [(f.name, f.a, f.b) for f in result.fields] == [("exit code", 0, 3)]
    assert [(r.table, r.key, r.difference) for r in result.db] == [
        ("proposals", {"id": 42}, "values")
    ]
    assert [h.host for h in result.egress] == ["api.example"]
    assert result.lines()[2] == "first divergence: exit code: 0 -> 3"


def test_file_content_is_compared(tmp_path: Path) -> None:
    runs = tmp_path / "wf" / "runs"
    a = finished_run(runs / "test-a", [], files={"created": ["out.md"]})
    b = finished_run(runs / "test-b", [], files={"created": ["out.md", "new.md"]})
    (a / "g" / "out.md").write_text("15 Connects")
    (b / "g" / "out.md").write_text("16 Connects")
    (b / "g" / "new.md").write_text("x")
    result = compare(a, b)
    assert [(f.path, f.a, f.b, f.content) for f in result.files] == [
        ("new.md", None, "created", None),
        ("out.md", "created", "created", "differs"),
    ]


def test_text_is_terminal_safe_and_json_for_programs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = two_runs(tmp_path, [submit()], [submit(text="\x1b[2J\x1b]0;owned\x07")])
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "text" in out
    assert main(["diff", str(a), str(b), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["calls"][0]["arguments"][0]["path"] == "text"
    assert main(["diff", str(a), str(a)]) == 0


def test_an_unsealed_run_is_not_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = two_runs(tmp_path, [submit()], [submit()], log_synced_at=None)
    with pytest.raises(ConfigError, match=r"run B .*the action log was not sealed"):
        compare(a, b)
    assert main(["diff", str(a), str(b)]) == ExitCode.CONFIG
    assert "not sealed" in capsys.readouterr().err
