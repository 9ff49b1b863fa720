"""The record's stubbed list from a real action log (the guard's own writer): every
distinct stubbed tool listed with its exact count, whatever came before it; a cut is
counted, never silent; a chain merges its steps' groups exactly. And the one
definition of an effect the gate uses."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandbox.collect import stubgroups
from sandbox.collect.actionsummary import read
from sandbox.collect.stubgroups import MAX_OTHER_GROUPS, args_digest
from sandbox.contracts.record import (
    ActionCounts,
    RunStatus,
    StubbedAction,
    StubbedCut,
    TestRunRecord,
)
from sandbox.contracts.reports import DbDiff, TableDiff
from sandbox.contracts.workflow_record import WorkflowRunRecord
from sandbox.verify.effects import effect_lines, effects_of, why_not_effect_free
from tests.collect.logparts import write_log

SUBMIT = {"job_id": 42, "text": "my proposal", "connects": 16}


def _record(**fields: Any) -> TestRunRecord:
    base: dict[str, Any] = {
        "id": "test-1",
        "workflow_dir": "/wf",
        "workflow_name": "wf",
        "step_id": "s",
        "group": "g",
        "command": "true",
        "status": RunStatus.PASSED,
        "started_at": datetime.now(UTC),
        "no_db": True,
    }
    return TestRunRecord(**(base | fields))


def test_600_harmless_stubs_then_a_submission_keeps_the_submission_and_counts_exactly(
    tmp_path: Path,
) -> None:
    log = tmp_path / "actions.jsonl"
    harmless = [("record_goal_observations", "stub", {"n": i}) for i in range(600)]
    write_log(log, [*harmless, ("upwork_submit_proposal", "stub", SUBMIT)])
    summary = read(log)
    assert summary.counts.stub == 601
    by_tool = {g.tool: g for g in summary.stubbed}
    assert set(by_tool) == {"record_goal_observations", "upwork_submit_proposal"}
    submit = by_tool["upwork_submit_proposal"]
    assert (submit.count, submit.first_line, submit.last_line) == (1, 601, 601)
    assert submit.first_args == submit.last_args == args_digest(SUBMIT)
    assert submit.detail == "job_id=42"
    harmless_group = by_tool["record_goal_observations"]
    assert (harmless_group.count, harmless_group.first_line, harmless_group.last_line) == (
        600,
        1,
        600,
    )
    assert harmless_group.first_args == args_digest({"n": 0})
    assert harmless_group.last_args == args_digest({"n": 599})
    assert summary.stubbed_cut.groups == summary.stubbed_cut.calls == 0

    record = _record(
        stubbed=summary.stubbed, stubbed_cut=summary.stubbed_cut, actions=summary.counts
    )
    lines = record.summary_lines()
    assert lines[1] == "601 call(s) were stubbed (would have run), 2 distinct tool(s):"
    assert any(
        line.startswith("  - upwork_submit_proposal x1: ") and "(log line 601)" in line
        for line in lines
    )
    assert any("record_goal_observations x600" in line for line in lines)


def test_a_hostile_number_of_tool_names_is_cut_counted_never_the_effects_tables(
    tmp_path: Path,
) -> None:
    log = tmp_path / "actions.jsonl"
    flood: list[tuple[str, str, dict[str, Any]]] = [(f"decoy_{i}", "stub", {}) for i in range(1000)]
    calls = [
        *flood[:500],
        ("send_email", "stub", {"to": "x@example.org"}),  # a tool of the effects table
        ("decoy_7", "stub", {}),  # a second call of a group that is kept
        *flood[500:],
        ("upwork_submit_proposal", "stub", SUBMIT),
    ]
    write_log(log, calls)
    summary = read(log)
    listed = {g.tool for g in summary.stubbed}
    cut = summary.stubbed_cut
    assert summary.counts.stub == 1003
    assert "send_email" in listed and "upwork_submit_proposal" in listed  # first / last
    assert len(listed) == MAX_OTHER_GROUPS + 1  # the table's tool is outside the cap
    assert cut.groups == 1001 - MAX_OTHER_GROUPS
    assert sum(g.count for g in summary.stubbed) + cut.calls == summary.counts.stub
    record = _record(stubbed=summary.stubbed, stubbed_cut=cut, actions=summary.counts)
    lines = record.summary_lines()
    assert lines[1] == "1003 call(s) were stubbed (would have run), 1002 distinct tool(s):"
    assert f"  - {cut.groups} more tool(s) with {cut.calls} call(s), cut from this list" in (
        "\n".join(lines)
    )


def test_a_chain_merges_its_steps_groups_with_each_steps_count() -> None:
    def group(tool: str, count: int, first: int, last: int) -> StubbedAction:
        return StubbedAction(
            tool=tool, reason="r", count=count, first_line=first, last_line=last, last_args=tool
        )

    first = [group("notify_user", 600, 1, 600), group("send_email", 1, 601, 601)]
    second = [group("upwork_submit_proposal", 1, 3, 3), group("notify_user", 2, 1, 2)]
    cut = StubbedCut(groups=3, calls=9)
    merged, chain_cut = stubgroups.merge([("a", first, StubbedCut()), ("b", second, cut)])
    by_tool = {g.tool: g for g in merged}
    assert [g.tool for g in merged] == ["notify_user", "send_email", "upwork_submit_proposal"]
    notify = by_tool["notify_user"]
    assert notify.count == 602 and notify.steps == {"a": 600, "b": 2}
    assert (notify.step_id, notify.first_line, notify.last_step_id, notify.last_line) == (
        "a",
        1,
        "b",
        2,
    )
    assert by_tool["upwork_submit_proposal"].steps == {"b": 1}
    assert (chain_cut.groups, chain_cut.calls) == (3, 9)


def test_old_records_with_one_entry_per_call_still_load_and_show() -> None:
    old = _record(actions=ActionCounts(stub=501)).model_dump(mode="json")
    old["stubbed"] = [{"tool": "notify_user", "reason": "r", "detail": ""}] * 500
    del old["stubbed_cut"]
    lines = TestRunRecord.model_validate(old).summary_lines()
    assert lines[1] == "501 call(s) were stubbed (would have run), 500 distinct tool(s):"
    assert lines[-1] != "" and "  - 1 more call(s) not listed (see the action log)" in lines
    chain = WorkflowRunRecord.model_validate(
        {
            "id": "test-2",
            "workflow_dir": "/wf",
            "workflow_name": "wf",
            "status": "passed",
            "started_at": datetime.now(UTC).isoformat(),
            "stubbed": [{"step_id": "a", "tool": "notify_user", "reason": "r"}],
        }
    )
    assert chain.stubbed[0].count == 1


def test_a_redirect_counts_as_a_write_unless_its_sql_is_a_read(tmp_path: Path) -> None:
    log = tmp_path / "actions.jsonl"
    write_log(
        log,
        [
            ("query_workflow_db", "redirect", {"sql": "SELECT * FROM jobs"}),
            ("mutate_workflow_db", "redirect", {"sql": "SELECT 1"}),
            ("mutate_workflow_db", "redirect", {"sql": "INSERT INTO proposals VALUES (42)"}),
            ("mutate_workflow_db", "redirect", {"sql": "UPDATE jobs SET status = 'claimed'"}),
        ],
    )
    counts = read(log).counts
    assert (counts.redirect, counts.redirect_write) == (4, 2)
    effects = effects_of(_record(actions=counts))
    assert [e.kind for e in effects] == ["redirected_write"]


def _diff(changed: bool) -> DbDiff:
    tables = [TableDiff(name="proposals", status="changed", inserted=1)] if changed else []
    return DbDiff(before="db.sqlite", after="copy.sqlite", tables=tables)


def test_effects_are_stubs_refusals_db_writes_and_an_incomplete_log_not_output() -> None:
    quiet = _record(actions=ActionCounts(allow=3, redirect_write=0), no_db=False)
    quiet.db_diff = _diff(False)
    quiet.files.created = ["claim.json"]  # the step's own output
    assert effects_of(quiet) == [] and why_not_effect_free(quiet) == ""
    assert effect_lines(quiet)[0].startswith("effects: none")

    wrote = quiet.model_copy(update={"db_diff": _diff(True)})
    assert [e.kind for e in effects_of(wrote)] == ["db_write"]
    assert "proposals: 1 inserted" in why_not_effect_free(wrote)

    failed_diff = quiet.model_copy(update={"db_diff": DbDiff(before="a", after="b", error="x")})
    assert [e.kind for e in effects_of(failed_diff)] == ["db_write"]

    for counts, kind in (
        (ActionCounts(stub=1, redirect_write=0), "stubbed"),
        (ActionCounts(refuse=1, redirect_write=0), "refused"),
        (ActionCounts(log_full=True, redirect_write=0), "incomplete_log"),
        (ActionCounts(outcome_unknown=1, redirect_write=0), "incomplete_log"),
        (ActionCounts(malformed=1, redirect_write=0), "incomplete_log"),
        (ActionCounts(redirect=2), "redirected_write"),  # a record from before the count
    ):
        assert [e.kind for e in effects_of(_record(actions=counts))] == [kind], counts
    stopped = _record(status=RunStatus.ERROR)
    assert effects_of(stopped) == [] and why_not_effect_free(stopped) == "it did not pass (error)"
