"""The test-mode effects table: the one place that decides what a guarded call may do.

Every tool call a step makes in test mode (agent loop, bridge API, MCP proxy) is
put to :func:`decide` (platform and local tools) or :func:`decide_mcp` (tools of
connected MCP servers). The answer is a :class:`Verdict`: allow it, stub it (it
does not run; the caller returns :func:`stub_reply`), redirect it into the test
run's own copy, or refuse it.

What this module guarantees:

* Fail closed. A tool name that is not in :data:`EFFECTS_TABLE` is stubbed, as is
  an empty or non-string name, an unknown browser command, and an MCP tool without
  a trustworthy ``readOnlyHint: true``. Nothing runs unless a row says it may.
* SQL for the workflow DB is classified conservatively (:func:`classify_sql`, in
  :mod:`sandbox.policy_sql`):
  comments and literals are removed before keywords are read, and SQL that cannot
  be classified is never treated as a read.
* Crew calls are refused and fail the step; calls that would start another test
  run (or a real run) from inside a test run are refused.
* Pure: no Docker, no I/O, no network, no clock. The same inputs give the same
  verdict, so the table can be tested exhaustively.

What it does not guarantee:

* MCP annotations are the server's own claim. A server that marks a write tool
  ``readOnlyHint: true`` defeats test mode for that tool; :func:`decide_mcp`
  trusts the annotation (or the owner's explicit override) and nothing else.
* Reads stay real: an allowed browser navigation is a real GET and can have side
  effects (an unsubscribe or magic-login link), and an allowed ``reload`` reloads
  whatever the page is.
* Local tools are allowed here; which paths they may touch is decided by
  :mod:`sandbox.stepside.agentworks_exec.pathsafety` and by the container's mounts,
  not by this module.
* Shell commands run in the step container; their network is contained by the
  egress proxy and firewall, not by this table. What a request to an allow-listed
  host may do is :func:`http_kind` (GET and HEAD, and git's fetch, pass), which the
  egress proxy applies; which hosts are on the list is the workflow's.

Adding a tool to the allow list is one line in ``_EFFECTS_ROWS``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Final

from pydantic import BaseModel

from sandbox.policy_sql import SqlKind, classify_sql

__all__ = [
    "BROWSER_ALLOWED_COMMANDS",
    "EFFECTS_TABLE",
    "GIT_FETCH_CONTENT_TYPE",
    "GIT_FETCH_SUFFIX",
    "GIT_PUSH_SUFFIX",
    "HTTP_READ_METHODS",
    "STUB_TEMPLATE",
    "Decision",
    "Handling",
    "HttpKind",
    "Route",
    "Row",
    "SqlKind",
    "Verdict",
    "classify_sql",
    "decide",
    "decide_mcp",
    "http_effect_reason",
    "http_kind",
    "stub_reply",
]


class Decision(StrEnum):
    """What happens to a guarded call (also the ``decision`` field of the action log)."""

    ALLOW = "allow"
    STUB = "stub"
    REDIRECT = "redirect"
    REFUSE = "refuse"


class Route(StrEnum):
    """Where an allowed or redirected call is executed."""

    UPSTREAM = "upstream"  # forward to the real bridge upstream (model, allowed browser, reads)
    LOCAL = "local"  # local agent tool executed inside the step container
    DB = "db"  # run against the test run's DB copy
    SESSION = "session"  # create a child test session (sub-agents) inside the same test run
    NONE = "none"  # nothing runs (stub / refuse)


class Verdict(BaseModel, frozen=True):
    """The answer for one guarded call."""

    decision: Decision
    route: Route
    category: str  # the effects-table row, e.g. "model", "messaging", "crew", "unknown"
    reason: str  # short human reason, used inside the stub reply and the action log
    fails_step: bool = False  # True for Crew calls: the step must fail


STUB_TEMPLATE: Final = (
    "TEST MODE: {tool} was NOT run ({reason}). "
    "Continue as if it succeeded; do not look for another way to perform it."
)


def stub_reply(tool: str, reason: str) -> str:
    """The reply a stubbed call returns to the agent, word for word."""
    return STUB_TEMPLATE.format(tool=tool, reason=reason)


# --------------------------------------------------------------------------- the table


class Handling(StrEnum):
    """How a row turns a call into a verdict."""

    FIXED = "fixed"  # the row's decision, route and reason, whatever the arguments
    DB_QUERY = "db_query"  # read-only SQL against the copy (``sql`` argument)
    DB_MUTATE = "db_mutate"  # read or write SQL against the copy (``sql`` argument)
    DB_ADMIN = "db_admin"  # migrations and backup snapshots: stubbed
    BROWSER = "browser"  # depends on the first word of the ``command`` argument


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the effects table.

    For ``FIXED`` rows ``decision``/``route``/``reason`` are the verdict. For the
    other handlings they describe the permitted outcome (e.g. a DB read redirected
    to the copy, an allowed browser command); the arguments can only make it
    stricter (stub or refuse), never looser.
    """

    category: str
    decision: Decision
    route: Route
    reason: str
    handling: Handling = Handling.FIXED
    fails_step: bool = False


MODEL: Final = Row(
    "model", Decision.ALLOW, Route.UPSTREAM, "model calls are allowed (cost only, no effect)"
)
READ: Final = Row("reads", Decision.ALLOW, Route.UPSTREAM, "reads stay real in test mode")
DB_QUERY: Final = Row(
    "workflow_db",
    Decision.REDIRECT,
    Route.DB,
    "read-only query runs against the test run's DB copy",
    Handling.DB_QUERY,
)
DB_MUTATE: Final = Row(
    "workflow_db",
    Decision.REDIRECT,
    Route.DB,
    "runs against the test run's DB copy",
    Handling.DB_MUTATE,
)
DB_ADMIN: Final = Row(
    "workflow_db",
    Decision.STUB,
    Route.NONE,
    "migrations and backup snapshots are stubbed",
    Handling.DB_ADMIN,
)
LOCAL: Final = Row(
    "local", Decision.ALLOW, Route.LOCAL, "local tool runs inside the step container"
)
SUB_AGENT: Final = Row(
    "sub_agent",
    Decision.ALLOW,
    Route.SESSION,
    "runs inside the test run as a child test session",
)
BROWSER: Final = Row(
    "browser",
    Decision.ALLOW,
    Route.UPSTREAM,
    "read-only browser command",
    Handling.BROWSER,
)
MESSAGING: Final = Row("messaging", Decision.STUB, Route.NONE, "messages are not sent in test mode")
DELEGATION: Final = Row(
    "delegation",
    Decision.STUB,
    Route.NONE,
    "workflow functions, triggers, delegation and webhooks are stubbed in test mode",
)
SCHEDULES: Final = Row(
    "schedules", Decision.STUB, Route.NONE, "schedule changes are stubbed in test mode"
)
KNOWLEDGE: Final = Row(
    "knowledge",
    Decision.STUB,
    Route.NONE,
    "knowledge and learnings writes are stubbed in test mode",
)
GOAL_METRICS: Final = Row(
    "goal_metrics", Decision.STUB, Route.NONE, "goal metrics are not recorded in test mode"
)
CREW: Final = Row(
    "crew",
    Decision.REFUSE,
    Route.NONE,
    "a Crew call acts in another project; Crew calls are refused in test mode",
    fails_step=True,
)
RECURSION: Final = Row(
    "recursion",
    Decision.REFUSE,
    Route.NONE,
    "recursive test runs are not allowed: this call came from inside a test run",
)

# One line per tool, top to bottom. A tool that is not here is stubbed (fail closed).
# Adding a tool to the allow list is one line: ("tool_name", READ),
_EFFECTS_ROWS: Final[tuple[tuple[str, Row], ...]] = (
    # model calls
    ("generate_text_llm", MODEL),
    # reads (forwarded upstream, real)
    ("get_run_status", READ),
    ("list_steps", READ),
    ("read_learnings", READ),
    ("read_knowledgebase", READ),
    ("web_search", READ),
    ("web_fetch", READ),
    # workflow DB (redirected to the test run's copy)
    ("query_workflow_db", DB_QUERY),
    ("mutate_workflow_db", DB_MUTATE),
    ("agentworks_db", DB_MUTATE),
    ("migrate_workflow_db", DB_ADMIN),
    ("backup_workflow_db", DB_ADMIN),
    ("snapshot_workflow_db", DB_ADMIN),
    # local tools (paths checked by sandbox.stepside.agentworks_exec.pathsafety)
    ("read_file", LOCAL),
    ("write_file", LOCAL),
    ("edit_file", LOCAL),
    ("list_dir", LOCAL),
    ("search_files", LOCAL),
    ("execute_shell_command", LOCAL),
    # sub-agents (child test sessions)
    ("call_sub_agent", SUB_AGENT),
    ("call_scripted_sub_agent", SUB_AGENT),
    # browser (decided per command)
    ("agent_browser", BROWSER),
    # messaging
    ("notify_user", MESSAGING),
    ("send_slack_message", MESSAGING),
    ("human_feedback", MESSAGING),
    ("create_human_input_request", MESSAGING),
    ("google_workspace_cli", MESSAGING),
    ("send_email", MESSAGING),
    ("send_whatsapp_message", MESSAGING),
    # workflow functions, triggers, delegation, webhooks
    ("call_generic_agent", DELEGATION),
    ("delegate_to_chat", DELEGATION),
    ("chat_delegate", DELEGATION),
    ("trigger_workflow", DELEGATION),
    ("call_webhook", DELEGATION),
    ("send_webhook", DELEGATION),
    # schedules
    ("create_schedule", SCHEDULES),
    ("update_schedule", SCHEDULES),
    ("delete_schedule", SCHEDULES),
    ("schedule_run", SCHEDULES),
    # knowledge and learnings writes
    ("update_knowledgebase", KNOWLEDGE),
    ("write_learning", KNOWLEDGE),
    ("save_learning", KNOWLEDGE),
    ("save_script", KNOWLEDGE),
    ("record_script_stats", KNOWLEDGE),
    ("confirm_freshness", KNOWLEDGE),
    # goal metrics
    ("record_goal_observations", GOAL_METRICS),
    # Crew (refused; the step fails)
    ("crew", CREW),
    ("call_crew", CREW),
    ("crew_step", CREW),
    # recursion (no test run or real run from inside a test run)
    ("execute_step", RECURSION),
    ("run_full_workflow", RECURSION),
    ("test_run", RECURSION),
    ("run_test_mode", RECURSION),
    ("start_test_run", RECURSION),
)


def _build_table(rows: Iterable[tuple[str, Row]]) -> Mapping[str, Row]:
    table: dict[str, Row] = {}
    for tool, row in rows:
        if tool in table:
            raise ValueError(f"effects table lists {tool!r} twice")
        table[tool] = row
    return MappingProxyType(table)


EFFECTS_TABLE: Final[Mapping[str, Row]] = _build_table(_EFFECTS_ROWS)
"""Tool name -> row. Read-only view of ``_EFFECTS_ROWS``; names are matched exactly."""

UNKNOWN_REASON: Final = "not on the test-mode list; unknown tools are stubbed"

BROWSER_ALLOWED_COMMANDS: Final[frozenset[str]] = frozenset(
    {
        "status",
        "skills",
        "tab",
        "open",
        "goto",
        "navigate",
        "back",
        "forward",
        "reload",
        "snapshot",
        "get",
        "is",
        "screenshot",
        "pdf",
        "console",
        "errors",
        "wait",
        "scroll",
    }
)
"""Commands of ``agent_browser`` that run, when the whole command is one of them
(no chaining, no JavaScript); every other command is stubbed."""

# --------------------------------------------------------------------------- decide


def _verdict(row: Row, *, reason: str | None = None) -> Verdict:
    return Verdict(
        decision=row.decision,
        route=row.route,
        category=row.category,
        reason=row.reason if reason is None else reason,
        fails_step=row.fails_step,
    )


# A fixed row's verdict never changes (Verdict is frozen): made once per tool, not per call.
_FIXED_VERDICTS: dict[str, Verdict] = {}


def _fixed_verdict(tool: str, row: Row) -> Verdict:
    verdict = _FIXED_VERDICTS.get(tool)
    if verdict is None:
        verdict = _FIXED_VERDICTS[tool] = _verdict(row)
    return verdict


def _stub(category: str, reason: str) -> Verdict:
    return Verdict(decision=Decision.STUB, route=Route.NONE, category=category, reason=reason)


def _refuse(category: str, reason: str) -> Verdict:
    return Verdict(decision=Decision.REFUSE, route=Route.NONE, category=category, reason=reason)


def decide(tool: str, arguments: Mapping[str, Any], *, has_db_copy: bool) -> Verdict:
    """Decide one platform or local tool call in test mode.

    ``tool`` is matched exactly against :data:`EFFECTS_TABLE`; anything else,
    including an empty or non-string name, is stubbed as ``unknown``.
    ``has_db_copy`` says whether this test run has a DB copy; without one every
    workflow DB tool is refused.
    """
    row = EFFECTS_TABLE.get(tool) if isinstance(tool, str) and tool else None
    if row is None:
        return _stub("unknown", UNKNOWN_REASON)
    args: Mapping[str, Any] = arguments if isinstance(arguments, Mapping) else {}
    match row.handling:
        case Handling.FIXED:
            return _fixed_verdict(tool, row)
        case Handling.BROWSER:
            return _decide_browser(row, args.get("command"))
        case Handling.DB_QUERY | Handling.DB_MUTATE | Handling.DB_ADMIN:
            return _decide_db(tool, row, args, has_db_copy=has_db_copy)
    return _stub("unknown", UNKNOWN_REASON)  # pragma: no cover - every Handling is matched


# URL schemes that carry the agent's own JavaScript (or markup that runs it), as a
# word or an option's value (``--url=javascript:...``).
_SCRIPT_URL: Final = re.compile(r"(?:^|=)(?:javascript|data|vbscript):")
# Outside quotes, these chain, pipe, redirect, background or group a second command.
_SHELL_OPERATORS: Final = frozenset(";&|<>()")
# Substitutions run a command inside an argument, even inside double quotes.
_SUBSTITUTIONS: Final = ("`", "$(", "${")
NOT_ONE_COMMAND_REASON: Final = "the browser command is not exactly one allowed command"


def _one_browser_command(command: str) -> list[str] | None:
    """The command's words when it is exactly one command, else None.

    One command: one line of printable characters (no newline, tab or other
    control character), no substitution, no shell operator outside quotes, and
    quotes that balance. Quoted operators are argument text (``get text "a;b"``).
    Anything this cannot parse is not one command."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in command):
        return None
    if any(marker in command for marker in _SUBSTITUTIONS):
        return None
    quote = ""
    i = 0
    while i < len(command):
        c = command[i]
        if quote == "'":
            quote = "" if c == "'" else quote
        elif c == "\\":
            i += 1  # the next character is literal, in double quotes and out
        elif quote == '"':
            quote = "" if c == '"' else quote
        elif c in "'\"":
            quote = c
        elif c in _SHELL_OPERATORS:
            return None
        i += 1
    if quote:
        return None
    try:
        words = shlex.split(command, comments=False, posix=True)
    except ValueError:
        return None
    return words or None


def _runs_script(words: Iterable[str]) -> bool:
    return any(_SCRIPT_URL.search(w.strip("'\" ").lower()) for w in words)


def _decide_browser(row: Row, command: object) -> Verdict:
    """Allowed only when the whole command is one allowed command without JavaScript."""
    if not isinstance(command, str) or not command.split():
        return _stub(row.category, "missing or empty browser command")
    # JavaScript first, on the rough words, so its reason names it even in a chain.
    rough = command.split()
    if rough[0].lower() == "eval" or _runs_script(rough):
        return _stub(row.category, "JavaScript cannot be classified")
    words = _one_browser_command(command)
    if words is None:
        return _stub(row.category, NOT_ONE_COMMAND_REASON)
    verb = words[0].lower()
    if verb == "eval" or _runs_script(words):
        return _stub(row.category, "JavaScript cannot be classified")
    if verb not in BROWSER_ALLOWED_COMMANDS:
        return _stub(row.category, f"browser command {verb!r} can have effects")
    # ``wait --fn <js>`` runs the agent's own JavaScript, which can submit a form as
    # easily as read a title.
    options = [w.lower() for w in words[1:]]
    if verb == "wait" and any(w == "--fn" or w.startswith("--fn=") for w in options):
        return _stub(row.category, "JavaScript cannot be classified")
    return _verdict(row, reason=f"read-only browser command {verb!r}")


NO_DB_REASON: Final = "this test run has no DB copy (no DB access)"
FORBIDDEN_SQL_REASON: Final = (
    "this SQL could reach outside the DB copy or cannot be classified; it is refused"
)


def _decide_db(tool: str, row: Row, args: Mapping[str, Any], *, has_db_copy: bool) -> Verdict:
    if not has_db_copy:
        return _refuse(row.category, NO_DB_REASON)
    if row.handling is Handling.DB_ADMIN:
        return _verdict(row)
    sql = args.get("sql")
    if not isinstance(sql, str):
        return _refuse(row.category, "the 'sql' argument is missing or not a string")
    kind = classify_sql(sql)
    if kind is SqlKind.FORBIDDEN:
        return _refuse(row.category, FORBIDDEN_SQL_REASON)
    if row.handling is Handling.DB_QUERY:
        if kind is SqlKind.READ:
            return _verdict(row)
        return _stub(row.category, f"{tool} is read-only and this SQL is not a read")
    if kind is SqlKind.MIGRATION:
        return _stub(row.category, "migrations are stubbed in test mode")
    return _verdict(row, reason=f"{kind.value} runs against the test run's DB copy")


# --------------------------------------------------------------------------- MCP


def _clip(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def decide_mcp(
    annotations: Mapping[str, Any] | None,
    *,
    listed: bool,
    lookup_error: str | None = None,
    override_read_only: bool | None = None,
) -> Verdict:
    """Decide one MCP tool call from the server's live tool listing.

    Order: an unlisted tool or a failed lookup stubs; then the owner's
    per-connection override, if set, wins over the server's annotations; then
    the tool runs only if it is annotated ``readOnlyHint`` with the JSON boolean
    ``true`` (the MCP spelling only: ``read_only_hint`` or any other key is not an
    annotation; absent means false) and not also ``destructiveHint: true``. MCP
    defines ``destructiveHint`` only for non-read-only tools, so a tool claiming
    both is contradictory and stubbed.
    """
    if lookup_error is not None:
        return _stub("mcp", f"annotation lookup failed: {_clip(lookup_error)}")
    if not listed:
        return _stub("mcp", "the server does not list this tool")
    if override_read_only is True:
        return Verdict(
            decision=Decision.ALLOW,
            route=Route.UPSTREAM,
            category="mcp",
            reason="owner override marks it read-only",
        )
    if override_read_only is False:
        return _stub("mcp", "owner override marks it not read-only")
    ann: Mapping[str, Any] = annotations if isinstance(annotations, Mapping) else {}
    if ann.get("readOnlyHint") is not True:
        return _stub("mcp", "the server does not mark this tool read-only")
    destructive = ann.get("destructiveHint")
    if destructive is not None and destructive is not False:
        return _stub("mcp", "the server marks this tool both read-only and destructive")
    return Verdict(
        decision=Decision.ALLOW,
        route=Route.UPSTREAM,
        category="mcp",
        reason="the server marks this tool read-only",
    )


# --------------------------------------------------------------------------- HTTP egress


class HttpKind(StrEnum):
    """What a request to an allow-listed host is, for the egress row of the table."""

    READ = "read"  # GET or HEAD without a body: passes
    GIT_FETCH = "git fetch"  # git's smart-HTTP fetch (git-upload-pack): passes with its body
    GIT_PUSH = "git push"  # git's smart-HTTP push (git-receive-pack): stubbed
    EFFECT = "effect"  # any other method: stubbed


HTTP_READ_METHODS: Final = frozenset({"GET", "HEAD"})
# git's smart HTTP fetches with `POST <repo>/git-upload-pack`: the body lists the
# objects the client wants and has, the reply is a pack. upload-pack never writes to
# the repository, so it is a read; receive-pack (push) is an effect. The match is
# exact on both the end of the target and the content type, so no other POST can
# pass as a fetch by naming it somewhere in its URL or by leaving its type unsaid.
GIT_FETCH_SUFFIX: Final = "/git-upload-pack"
GIT_FETCH_CONTENT_TYPE: Final = "application/x-git-upload-pack-request"
GIT_PUSH_SUFFIX: Final = "/git-receive-pack"


def http_kind(method: str, target: str, content_type: str | None) -> HttpKind:
    """Classify a request to an allow-listed host by method, origin-form target
    (path and query) and Content-Type. A git fetch is a POST whose whole target ends
    in `/git-upload-pack` (no query) and whose Content-Type is exactly git's request
    type, without parameters; anything else that is not GET or HEAD is an effect."""
    if method in HTTP_READ_METHODS:
        return HttpKind.READ
    if method != "POST":
        return HttpKind.EFFECT
    fetch_type = (content_type or "").strip().lower() == GIT_FETCH_CONTENT_TYPE
    if fetch_type and target.endswith(GIT_FETCH_SUFFIX) and "?" not in target:
        return HttpKind.GIT_FETCH
    if target.split("?", 1)[0].endswith(GIT_PUSH_SUFFIX):
        return HttpKind.GIT_PUSH
    return HttpKind.EFFECT


def http_effect_reason(kind: HttpKind, method: str) -> str:
    """The stub reason for a request `http_kind` did not pass."""
    if kind is HttpKind.GIT_PUSH:
        return "git push (git-receive-pack) changes the repository; only fetches pass"
    return f"HTTP {method} can have effects; only GET and HEAD pass"
