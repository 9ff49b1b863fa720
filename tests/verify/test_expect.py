"""Expectations parse strictly: a typo is a usage error naming the file, line and field."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from sandbox.cli import main
from sandbox.contracts.config import load_workflow
from sandbox.contracts.errors import ConfigError
from sandbox.verify.expect import (
    SCHEMA_PATH,
    CallExpectation,
    Match,
    expectations_json_schema,
    load_expectations,
    parse_json_path,
)
from sandbox.verify.match import json_equal, json_subset, matches, select
from tests import paths

REPO = paths.REPO

HEAD = """\
name = "wf"

[[steps]]
id = "other"
group = "g"
command = "true"

[[steps]]
id = "step1"
group = "g"
command = "true"
"""


def workflow_with(tmp_path: Path, expect_toml: str, head: str = HEAD) -> Path:
    wf = tmp_path / "wf"
    wf.mkdir(parents=True)
    (wf / "workflow.toml").write_text(head + textwrap.dedent(expect_toml))
    return wf


def load(wf: Path, step: str = "step1") -> list[str]:
    workflow = load_workflow(wf)
    return [n.label for n in load_expectations(wf, workflow, workflow.step(step))]


def error_of(wf: Path, step: str = "step1") -> str:
    with pytest.raises(ConfigError) as info:
        load(wf, step)
    return str(info.value)


def test_committed_schema_matches_the_models() -> None:
    assert SCHEMA_PATH.read_text() == expectations_json_schema(), (
        "regenerate with: python -c 'from sandbox.verify.expect import *; "
        "SCHEMA_PATH.write_text(expectations_json_schema())'"
    )
    kinds = json.loads(SCHEMA_PATH.read_text())["properties"]["expect"]["items"]["discriminator"]
    assert set(kinds["mapping"]) == {
        "call",
        "no_call",
        "db",
        "no_other_db_changes",
        "file",
        "status",
    }


def test_a_misspelt_field_names_line_and_field_and_suggests_the_right_one(
    tmp_path: Path,
) -> None:
    wf = workflow_with(
        tmp_path,
        """
        [[steps.expect]]
        kind = "status"

        [[steps.expect]]
        kind = "call"
        tool = "upwork_submit_proposal"
        cuont = 1
        """,
    )
    text = error_of(wf)
    assert text == (
        f"{wf / 'workflow.toml'} line 19: steps[step1].expect[1].cuont: "
        "unknown field (did you mean 'count'?)"
    )
    # The CLI says the same, as a configuration error (exit 4), and runs nothing.
    assert main(["verify", str(wf), "step1"]) == 4
    assert not (wf / "runs").exists()


def test_a_wrong_kind_and_a_bad_matcher_are_named(tmp_path: Path) -> None:
    wf = workflow_with(
        tmp_path,
        """
        [[steps.expect]]
        kind = "cal"
        tool = "x"
        """,
    )
    text = error_of(wf)
    assert "line 14: steps[step1].expect[0].kind: " in text and "'call'" in text
    wf2 = workflow_with(
        tmp_path / "b",
        """
        [[steps.expect]]
        kind = "call"
        tool = "x"
        args = [{ path = "$.a", equals = 1, regex = "b" }]
        """,
    )
    text = error_of(wf2)
    assert "line 16: steps[step1].expect[0].args[0]" in text
    assert "exactly one of equals, subset, regex, contains, exists (got equals, regex)" in text
    wf3 = workflow_with(
        tmp_path / "c",
        """
        [[steps.expect]]
        kind = "call"
        tool = "x"
        args = [{ path = "$.a", regex = "(" }]
        """,
    )
    assert "not a regular expression" in error_of(wf3)


def test_an_expectation_file_that_does_not_parse_is_an_error_with_its_line(
    tmp_path: Path,
) -> None:
    wf = workflow_with(tmp_path, 'expect_file = "expect.toml"\n')
    (wf / "expect.toml").write_text('[[expect]]\nkind = "status"\nstatus = passed\n')
    text = error_of(wf)
    assert text.startswith(f"{wf / 'expect.toml'}: not valid TOML") and "line 3" in text
    (wf / "expect.toml").write_text(
        '[[expect]]\nkind = "status"\n\n[[expect]]\nkind = "db"\ntabel = "t"\n'
    )
    assert error_of(wf) == (
        f"{wf / 'expect.toml'} line 6: expect[1].tabel: unknown field (did you mean 'table'?)"
    )
    (wf / "expect.toml").write_text('[[expect]]\nkind = "file"\npath = "../x"\n')
    assert error_of(wf).startswith(f"{wf / 'expect.toml'} line 3: expect[0].path: ")


def test_no_expectations_and_dangling_order_are_errors(tmp_path: Path) -> None:
    wf = workflow_with(tmp_path, "")
    assert "step step1 has no expectations" in error_of(wf)
    wf2 = workflow_with(
        tmp_path / "b",
        """
        [[steps.expect]]
        kind = "call"
        tool = "a"
        after = "nothing"
        """,
    )
    assert "after names no expectation ('nothing'" in error_of(wf2)


def test_the_job_board_expectations_parse() -> None:
    wf = REPO / "examples" / "job-board"
    assert "submits the proposal once" in load(wf, "bid-submit")
    assert "claims exactly one proposals row" in load(wf, "bid-pick-job")
    assert "messages nobody else" in load(wf, "outreach")


def test_matchers_use_json_semantics() -> None:
    assert parse_json_path("$.a.b[0]['c d']") == ["a", "b", 0, "c d"]
    assert parse_json_path("a[2]") == ["a", 2]
    value = {"a": {"b": [{"c d": 1}]}, "n": 1, "t": True}
    assert select(value, "$.a.b[0]['c d']") == 1
    assert not json_equal(True, 1) and json_equal(1, 1.0)
    assert json_subset({"a": {"b": [{}]}}, value)
    assert not json_subset({"a": {"x": 1}}, value)
    assert matches(Match(path="$.n", equals=1), value)
    assert not matches(Match(path="$.t", equals=1), value)
    assert matches(Match(path="$.zz", exists=False), value)
    assert not matches(Match(path="$.zz", regex="."), value)
    call = CallExpectation(kind="call", tool="mcp:files/write_file")
    assert call.describe() == "mcp:files/write_file would have run at least 1 time(s)"


def test_committed_verification_schema_matches_the_model() -> None:
    from sandbox.verify.verification import SCHEMA_PATH as VERIFICATION_SCHEMA
    from sandbox.verify.verification import verification_json_schema

    assert VERIFICATION_SCHEMA.read_text() == verification_json_schema(), (
        "regenerate with: python -c 'from sandbox.verify.verification import *; "
        "SCHEMA_PATH.write_text(verification_json_schema())'"
    )


def test_history_keeps_each_verification_and_skips_lines_that_do_not_parse(
    tmp_path: Path,
) -> None:
    from datetime import UTC, datetime

    from sandbox.verify import history
    from sandbox.verify.verification import RunDigest, Verification

    def verification(n: int, passed: bool) -> Verification:
        return Verification(
            run_id=f"test-{n}",
            workflow_name="wf",
            step_id="s",
            at=datetime.now(UTC),
            passed=passed,
            expectations_digest="e",
            results=[],
            digest=RunDigest(status="passed"),
        )

    wf = tmp_path / "wf"
    (wf / "runs").mkdir(parents=True)
    for n, passed in ((1, True), (2, False)):
        history.append(wf, verification(n, passed))
        with open(history.history_path(wf), "a") as handle:
            handle.write('{"not": "an entry"}\nhalf a line\n')
    entries = history.read(wf, "s")
    assert [(e.run_id, e.passed) for e in entries] == [("test-1", True), ("test-2", False)]
    assert history.read(wf, "other") == []
    link = tmp_path / "elsewhere.jsonl"
    history.history_path(wf).rename(link)
    history.history_path(wf).symlink_to(link)
    assert history.read(wf) == []  # never read through a link
    with pytest.raises(OSError):
        history.append(wf, verification(3, True))
