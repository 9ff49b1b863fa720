"""Tests for sandbox.policy: the effects table, unknown tools, Crew, the workflow DB, MCP decisions."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pytest

from sandbox import policy
from sandbox.policy import (
    EFFECTS_TABLE,
    STUB_TEMPLATE,
    Decision,
    Handling,
    Route,
    Row,
    Verdict,
    decide,
    decide_mcp,
    stub_reply,
)

ALLOW, STUB, REDIRECT, REFUSE = Decision.ALLOW, Decision.STUB, Decision.REDIRECT, Decision.REFUSE
UP, LOCAL, DB, SESSION, NONE = Route.UPSTREAM, Route.LOCAL, Route.DB, Route.SESSION, Route.NONE

# Hand-written expectations, independent of the table's data: a wrong edit of the
# table (a tool moved to the wrong row, dropped or added) fails one of the tests
# below. (tool, arguments, decision, route, category, fails_step); DB tools are
# called with a DB copy and a plain SELECT, the browser with "snapshot".
EXPECTED: list[tuple[str, dict[str, Any], Decision, Route, str, bool]] = [
    ("generate_text_llm", {}, ALLOW, UP, "model", False),
    ("get_run_status", {}, ALLOW, UP, "reads", False),
    ("list_steps", {}, ALLOW, UP, "reads", False),
    ("read_learnings", {}, ALLOW, UP, "reads", False),
    ("read_knowledgebase", {}, ALLOW, UP, "reads", False),
    ("web_search", {}, ALLOW, UP, "reads", False),
    ("web_fetch", {}, ALLOW, UP, "reads", False),
    ("query_workflow_db", {"sql": "SELECT 1"}, REDIRECT, DB, "workflow_db", False),
    ("mutate_workflow_db", {"sql": "SELECT 1"}, REDIRECT, DB, "workflow_db", False),
    ("agentworks_db", {"sql": "SELECT 1"}, REDIRECT, DB, "workflow_db", False),
    ("migrate_workflow_db", {"sql": "SELECT 1"}, STUB, NONE, "workflow_db", False),
    ("backup_workflow_db", {}, STUB, NONE, "workflow_db", False),
    ("snapshot_workflow_db", {}, STUB, NONE, "workflow_db", False),
    ("read_file", {}, ALLOW, LOCAL, "local", False),
    ("write_file", {}, ALLOW, LOCAL, "local", False),
    ("edit_file", {}, ALLOW, LOCAL, "local", False),
    ("list_dir", {}, ALLOW, LOCAL, "local", False),
    ("search_files", {}, ALLOW, LOCAL, "local", False),
    ("execute_shell_command", {}, ALLOW, LOCAL, "local", False),
    ("call_sub_agent", {}, ALLOW, SESSION, "sub_agent", False),
    ("call_scripted_sub_agent", {}, ALLOW, SESSION, "sub_agent", False),
    ("agent_browser", {"command": "snapshot"}, ALLOW, UP, "browser", False),
    ("notify_user", {}, STUB, NONE, "messaging", False),
    ("send_slack_message", {}, STUB, NONE, "messaging", False),
    ("human_feedback", {}, STUB, NONE, "messaging", False),
    ("create_human_input_request", {}, STUB, NONE, "messaging", False),
    ("google_workspace_cli", {}, STUB, NONE, "messaging", False),
    ("send_email", {}, STUB, NONE, "messaging", False),
    ("send_whatsapp_message", {}, STUB, NONE, "messaging", False),
    ("call_generic_agent", {}, STUB, NONE, "delegation", False),
    ("delegate_to_chat", {}, STUB, NONE, "delegation", False),
    ("chat_delegate", {}, STUB, NONE, "delegation", False),
    ("trigger_workflow", {}, STUB, NONE, "delegation", False),
    ("call_webhook", {}, STUB, NONE, "delegation", False),
    ("send_webhook", {}, STUB, NONE, "delegation", False),
    ("create_schedule", {}, STUB, NONE, "schedules", False),
    ("update_schedule", {}, STUB, NONE, "schedules", False),
    ("delete_schedule", {}, STUB, NONE, "schedules", False),
    ("schedule_run", {}, STUB, NONE, "schedules", False),
    ("update_knowledgebase", {}, STUB, NONE, "knowledge", False),
    ("write_learning", {}, STUB, NONE, "knowledge", False),
    ("save_learning", {}, STUB, NONE, "knowledge", False),
    ("save_script", {}, STUB, NONE, "knowledge", False),
    ("record_script_stats", {}, STUB, NONE, "knowledge", False),
    ("confirm_freshness", {}, STUB, NONE, "knowledge", False),
    ("record_goal_observations", {}, STUB, NONE, "goal_metrics", False),
    ("crew", {}, REFUSE, NONE, "crew", True),
    ("call_crew", {}, REFUSE, NONE, "crew", True),
    ("crew_step", {}, REFUSE, NONE, "crew", True),
    ("execute_step", {}, REFUSE, NONE, "recursion", False),
    ("run_full_workflow", {}, REFUSE, NONE, "recursion", False),
    ("test_run", {}, REFUSE, NONE, "recursion", False),
    ("run_test_mode", {}, REFUSE, NONE, "recursion", False),
    ("start_test_run", {}, REFUSE, NONE, "recursion", False),
]

ALLOWED_TOOLS = {
    "generate_text_llm",
    "get_run_status",
    "list_steps",
    "read_learnings",
    "read_knowledgebase",
    "web_search",
    "web_fetch",
    "read_file",
    "write_file",
    "edit_file",
    "list_dir",
    "search_files",
    "execute_shell_command",
    "call_sub_agent",
    "call_scripted_sub_agent",
    "agent_browser",
}


def _args_for(row: Row) -> dict[str, Any]:
    if row.handling is Handling.BROWSER:
        return {"command": "snapshot"}
    if row.handling in (Handling.DB_QUERY, Handling.DB_MUTATE):
        return {"sql": "SELECT 1"}
    return {}


# --------------------------------------------------------------------------- stub text


def test_stub_reply_is_word_for_word() -> None:
    assert stub_reply("send_email", "messages are not sent in test mode") == (
        "TEST MODE: send_email was NOT run (messages are not sent in test mode). "
        "Continue as if it succeeded; do not look for another way to perform it."
    )


def test_stub_template_is_word_for_word() -> None:
    assert STUB_TEMPLATE == (
        "TEST MODE: {tool} was NOT run ({reason}). "
        "Continue as if it succeeded; do not look for another way to perform it."
    )


def test_stub_reply_does_not_reinterpret_braces() -> None:
    assert stub_reply("t{x}", "r{0}") == (
        "TEST MODE: t{x} was NOT run (r{0}). "
        "Continue as if it succeeded; do not look for another way to perform it."
    )


# --------------------------------------------------------------------------- the table


def test_expected_list_covers_exactly_the_table() -> None:
    assert [t for t, *_ in EXPECTED] == list(EFFECTS_TABLE)


@pytest.mark.parametrize(
    ("tool", "args", "decision", "route", "category", "fails_step"),
    EXPECTED,
    ids=[e[0] for e in EXPECTED],
)
def test_expected_verdicts(
    tool: str,
    args: dict[str, Any],
    decision: Decision,
    route: Route,
    category: str,
    fails_step: bool,
) -> None:
    v = decide(tool, args, has_db_copy=True)
    assert (v.decision, v.route, v.category, v.fails_step) == (
        decision,
        route,
        category,
        fails_step,
    )
    assert v.reason
    assert v.reason[0].islower()
    assert not v.reason.endswith(".")


@pytest.mark.parametrize(("tool", "row"), list(EFFECTS_TABLE.items()), ids=list(EFFECTS_TABLE))
def test_every_row_decides_as_its_data(tool: str, row: Row) -> None:
    v = decide(tool, _args_for(row), has_db_copy=True)
    assert v.decision is row.decision
    assert v.route is row.route
    assert v.category == row.category
    assert v.fails_step is row.fails_step
    if row.handling is Handling.FIXED:
        assert v.reason == row.reason


@pytest.mark.parametrize(("tool", "row"), list(EFFECTS_TABLE.items()), ids=list(EFFECTS_TABLE))
def test_rows_are_consistent(tool: str, row: Row) -> None:
    nothing_runs = row.decision in (STUB, REFUSE)
    assert nothing_runs == (row.route is NONE)
    assert row.fails_step == (row.category == "crew")
    assert tool == tool.strip().lower()


def test_allowed_tools_are_exactly_the_allow_list() -> None:
    allowed = {t for t, r in EFFECTS_TABLE.items() if r.decision is ALLOW}
    assert allowed == ALLOWED_TOOLS


def test_adding_a_tool_is_one_line() -> None:
    # The table is module-level data: a tuple of (tool, row) lines, one per tool,
    # and a read-only mapping built from it. Every tool appears exactly once.
    rows = policy._EFFECTS_ROWS
    assert isinstance(rows, tuple)
    assert all(isinstance(t, str) and isinstance(r, Row) for t, r in rows)
    counts = Counter(t for t, _ in rows)
    assert [t for t, c in counts.items() if c != 1] == []
    assert dict(rows) == dict(EFFECTS_TABLE)
    assert isinstance(EFFECTS_TABLE, MappingProxyType)
    for tool in ALLOWED_TOOLS:
        assert counts[tool] == 1

    # decide() reads the table at call time; one more line allows one more tool.
    assert decide("brand_new_read", {}, has_db_copy=True).decision is STUB
    extended = policy._build_table((*rows, ("brand_new_read", policy.READ)))
    assert len(extended) == len(EFFECTS_TABLE) + 1
    original = policy.EFFECTS_TABLE
    try:
        policy.EFFECTS_TABLE = extended  # type: ignore[misc]
        v = decide("brand_new_read", {}, has_db_copy=True)
    finally:
        policy.EFFECTS_TABLE = original  # type: ignore[misc]
    assert (v.decision, v.route, v.category) == (ALLOW, UP, "reads")


def test_duplicate_tool_line_is_rejected() -> None:
    with pytest.raises(ValueError, match="twice"):
        policy._build_table((("web_search", policy.READ), ("web_search", policy.MESSAGING)))


def test_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        EFFECTS_TABLE["send_email"] = policy.READ  # type: ignore[index]


def test_verdict_is_frozen() -> None:
    v = decide("send_email", {}, has_db_copy=True)
    with pytest.raises(ValueError):
        v.decision = ALLOW  # type: ignore[misc]


# --------------------------------------------------------------------------- unknown


@pytest.mark.parametrize(
    "tool",
    [
        "",
        "   ",
        "frobnicate",
        "Send_Email",
        "GENERATE_TEXT_LLM",
        " read_file",
        "read_file ",
        None,
        3,
    ],
)
def test_unknown_tools_are_stubbed(tool: Any) -> None:
    v = decide(tool, {}, has_db_copy=True)
    assert v == Verdict(
        decision=STUB,
        route=NONE,
        category="unknown",
        reason="not on the test-mode list; unknown tools are stubbed",
    )


def test_unknown_stub_reply_text() -> None:
    v = decide("post_tweet", {}, has_db_copy=True)
    assert stub_reply("post_tweet", v.reason) == (
        "TEST MODE: post_tweet was NOT run (not on the test-mode list; unknown tools are "
        "stubbed). Continue as if it succeeded; do not look for another way to perform it."
    )


def test_non_mapping_arguments_fail_closed() -> None:
    v = decide("agent_browser", None, has_db_copy=True)  # type: ignore[arg-type]
    assert v.decision is STUB
    v = decide("query_workflow_db", "SELECT 1", has_db_copy=True)  # type: ignore[arg-type]
    assert v.decision is REFUSE


# --------------------------------------------------------------------------- crew, recursion


@pytest.mark.parametrize("tool", ["crew", "call_crew", "crew_step"])
def test_crew_is_refused_and_fails_the_step(tool: str) -> None:
    v = decide(tool, {"project": "other"}, has_db_copy=True)
    assert v == Verdict(
        decision=REFUSE,
        route=NONE,
        category="crew",
        reason="a Crew call acts in another project; Crew calls are refused in test mode",
        fails_step=True,
    )


@pytest.mark.parametrize(
    "tool", ["execute_step", "run_full_workflow", "test_run", "run_test_mode", "start_test_run"]
)
def test_recursion_is_refused(tool: str) -> None:
    v = decide(tool, {"step_id": "s1", "test_mode": True}, has_db_copy=False)
    assert v == Verdict(
        decision=REFUSE,
        route=NONE,
        category="recursion",
        reason="recursive test runs are not allowed: this call came from inside a test run",
        fails_step=False,
    )


def test_sub_agent_reason() -> None:
    v = decide("call_sub_agent", {}, has_db_copy=True)
    assert v.reason == "runs inside the test run as a child test session"


# --------------------------------------------------------------------------- workflow DB

DB_TOOLS = [t for t, r in EFFECTS_TABLE.items() if r.category == "workflow_db"]


def test_db_tools() -> None:
    assert DB_TOOLS == [
        "query_workflow_db",
        "mutate_workflow_db",
        "agentworks_db",
        "migrate_workflow_db",
        "backup_workflow_db",
        "snapshot_workflow_db",
    ]


@pytest.mark.parametrize("tool", DB_TOOLS)
@pytest.mark.parametrize("sql", ["SELECT 1", "DELETE FROM t", "ATTACH 'x' AS y", None])
def test_no_db_copy_refuses_every_db_tool(tool: str, sql: Any) -> None:
    v = decide(tool, {"sql": sql}, has_db_copy=False)
    assert v == Verdict(
        decision=REFUSE,
        route=NONE,
        category="workflow_db",
        reason="this test run has no DB copy (no DB access)",
    )


@pytest.mark.parametrize(
    ("tool", "sql", "decision", "route"),
    [
        ("query_workflow_db", "SELECT * FROM proposals", REDIRECT, DB),
        ("query_workflow_db", "WITH a AS (SELECT 1) SELECT * FROM a", REDIRECT, DB),
        ("query_workflow_db", "EXPLAIN QUERY PLAN SELECT 1", REDIRECT, DB),
        ("query_workflow_db", "UPDATE proposals SET claimed = 1", STUB, NONE),
        ("query_workflow_db", "CREATE TABLE x (a)", STUB, NONE),
        ("query_workflow_db", "ATTACH DATABASE '/etc/passwd' AS p", REFUSE, NONE),
        ("mutate_workflow_db", "SELECT 1", REDIRECT, DB),
        ("mutate_workflow_db", "INSERT INTO proposals (job) VALUES ('j1')", REDIRECT, DB),
        ("mutate_workflow_db", "UPDATE proposals SET claimed = 1 WHERE id = 3", REDIRECT, DB),
        ("mutate_workflow_db", "DELETE FROM proposals", REDIRECT, DB),
        ("mutate_workflow_db", "CREATE TABLE x (a)", STUB, NONE),
        ("mutate_workflow_db", "ALTER TABLE x ADD COLUMN b", STUB, NONE),
        ("mutate_workflow_db", "DROP TABLE proposals", STUB, NONE),
        ("mutate_workflow_db", "VACUUM", STUB, NONE),
        ("mutate_workflow_db", "REINDEX", STUB, NONE),
        ("mutate_workflow_db", "ATTACH 'other.db' AS o", REFUSE, NONE),
        ("mutate_workflow_db", "PRAGMA journal_mode = OFF", REFUSE, NONE),
        ("mutate_workflow_db", "SELECT load_extension('x')", REFUSE, NONE),
        ("agentworks_db", "SELECT 1", REDIRECT, DB),
        ("agentworks_db", "INSERT INTO t VALUES (1)", REDIRECT, DB),
        ("agentworks_db", "DROP TABLE t", STUB, NONE),
        ("agentworks_db", "DETACH o", REFUSE, NONE),
        ("migrate_workflow_db", "CREATE TABLE x (a)", STUB, NONE),
        ("backup_workflow_db", "SELECT 1", STUB, NONE),
        ("snapshot_workflow_db", "", STUB, NONE),
    ],
)
def test_db_decisions(tool: str, sql: str, decision: Decision, route: Route) -> None:
    v = decide(tool, {"sql": sql}, has_db_copy=True)
    assert (v.decision, v.route, v.category, v.fails_step) == (
        decision,
        route,
        "workflow_db",
        False,
    )


def test_db_reasons() -> None:
    def reason(tool: str, sql: str) -> str:
        return decide(tool, {"sql": sql}, has_db_copy=True).reason

    assert reason("mutate_workflow_db", "DROP TABLE t") == "migrations are stubbed in test mode"
    assert reason("migrate_workflow_db", "x") == "migrations and backup snapshots are stubbed"
    assert reason("backup_workflow_db", "x") == "migrations and backup snapshots are stubbed"
    assert reason("query_workflow_db", "DELETE FROM t") == (
        "query_workflow_db is read-only and this SQL is not a read"
    )
    assert "read-only" in reason("query_workflow_db", "CREATE TABLE t (a)")
    assert "refused" in reason("mutate_workflow_db", "ATTACH 'x' AS y")


@pytest.mark.parametrize("tool", ["query_workflow_db", "mutate_workflow_db", "agentworks_db"])
@pytest.mark.parametrize("args", [{}, {"sql": None}, {"sql": 1}, {"sql": b"SELECT 1"}, {"q": "x"}])
def test_db_missing_sql_is_refused(tool: str, args: Mapping[str, Any]) -> None:
    v = decide(tool, args, has_db_copy=True)
    assert (v.decision, v.route) == (REFUSE, NONE)
    assert v.reason == "the 'sql' argument is missing or not a string"


# --------------------------------------------------------------------------- MCP


def test_mcp_read_only_is_allowed() -> None:
    v = decide_mcp({"readOnlyHint": True}, listed=True)
    assert (v.decision, v.route, v.category, v.fails_step) == (ALLOW, UP, "mcp", False)


@pytest.mark.parametrize(
    "annotations",
    [{"read_only_hint": True}, {"readonlyhint": True}, {"read_only_hint": True, "readOnlyHint": 1}],
)
def test_mcp_only_the_standard_read_only_hint_counts(annotations: Any) -> None:
    """A tool annotated only with a non-standard spelling is a write for the guard."""
    v = decide_mcp(annotations, listed=True)
    assert (v.decision, v.route) == (STUB, NONE)
    assert v.reason == "the server does not mark this tool read-only"


def test_mcp_read_only_and_not_destructive_is_allowed() -> None:
    v = decide_mcp({"readOnlyHint": True, "destructiveHint": False, "title": "x"}, listed=True)
    assert v.decision is ALLOW
    # Non-standard keys are not annotations, in either direction.
    assert (
        decide_mcp({"readOnlyHint": True, "read_only_hint": False}, listed=True).decision is ALLOW
    )


@pytest.mark.parametrize(
    "annotations",
    [
        None,
        {},
        {"title": "Search jobs"},
        {"readOnlyHint": False},
        {"readOnlyHint": None},
        {"readOnlyHint": "true"},
        {"readOnlyHint": 1},
        {"destructiveHint": False},
        {"readOnlyHint": False, "destructiveHint": False},
        {"ReadOnlyHint": True},
    ],
)
def test_mcp_without_a_true_read_only_hint_is_stubbed(annotations: Any) -> None:
    v = decide_mcp(annotations, listed=True)
    assert (v.decision, v.route, v.category) == (STUB, NONE, "mcp")
    assert v.reason == "the server does not mark this tool read-only"


@pytest.mark.parametrize(
    "annotations",
    [
        {"readOnlyHint": True, "destructiveHint": True},
        {"readOnlyHint": True, "destructiveHint": "yes"},
        {"readOnlyHint": True, "destructiveHint": 0},
    ],
)
def test_mcp_read_only_and_destructive_is_stubbed(annotations: Any) -> None:
    v = decide_mcp(annotations, listed=True)
    assert (v.decision, v.route) == (STUB, NONE)
    assert v.reason == "the server marks this tool both read-only and destructive"


def test_mcp_unlisted_is_stubbed() -> None:
    v = decide_mcp({"readOnlyHint": True}, listed=False)
    assert v == Verdict(
        decision=STUB, route=NONE, category="mcp", reason="the server does not list this tool"
    )


def test_mcp_lookup_error_is_stubbed() -> None:
    v = decide_mcp({"readOnlyHint": True}, listed=True, lookup_error="connection reset")
    assert v == Verdict(
        decision=STUB,
        route=NONE,
        category="mcp",
        reason="annotation lookup failed: connection reset",
    )


def test_mcp_lookup_error_is_flattened_and_clipped() -> None:
    v = decide_mcp(None, listed=True, lookup_error="line one\nline two " + "x" * 500)
    assert v.decision is STUB
    assert v.reason.startswith("annotation lookup failed: line one line two x")
    assert "\n" not in v.reason
    assert len(v.reason) < 260


def test_mcp_override_read_only() -> None:
    v = decide_mcp(None, listed=True, override_read_only=True)
    assert (v.decision, v.route, v.category) == (ALLOW, UP, "mcp")
    assert "owner override marks it read-only" in v.reason
    v = decide_mcp({"readOnlyHint": False}, listed=True, override_read_only=True)
    assert v.decision is ALLOW


def test_mcp_override_not_read_only() -> None:
    v = decide_mcp({"readOnlyHint": True}, listed=True, override_read_only=False)
    assert (v.decision, v.route) == (STUB, NONE)
    assert v.reason == "owner override marks it not read-only"


def test_mcp_override_cannot_resurrect_unlisted_or_failed_lookup() -> None:
    assert decide_mcp(None, listed=False, override_read_only=True).decision is STUB
    v = decide_mcp(None, listed=True, lookup_error="timeout", override_read_only=True)
    assert v.decision is STUB


def test_mcp_non_mapping_annotations_are_stubbed() -> None:
    v = decide_mcp(["readOnlyHint"], listed=True)  # type: ignore[arg-type]
    assert v.decision is STUB


def test_mcp_stub_reply() -> None:
    v = decide_mcp({"readOnlyHint": False, "destructiveHint": True}, listed=True)
    assert stub_reply("gmail.send_message", v.reason) == (
        "TEST MODE: gmail.send_message was NOT run (the server does not mark this tool "
        "read-only). Continue as if it succeeded; do not look for another way to perform it."
    )
