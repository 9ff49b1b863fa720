"""Tests for sandbox.policy: the browser tool's allow-list of commands, and what is stubbed."""

from __future__ import annotations

from typing import Any

import pytest

from sandbox.policy import BROWSER_ALLOWED_COMMANDS, Decision, Route, Verdict, decide, stub_reply

ALLOW, STUB = Decision.ALLOW, Decision.STUB
UP, NONE = Route.UPSTREAM, Route.NONE

# --------------------------------------------------------------------------- browser

ALLOWED_BROWSER = [
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
]
STUBBED_BROWSER = [
    "click",
    "dblclick",
    "fill",
    "type",
    "press",
    "select",
    "hover",
    "check",
    "upload",
    "download",
    "route",
    "network",
    "record",
    "capture",
    "trace",
    "cookies",
    "storage",
    "set",
    "drag",
    "frobnicate",
]


def test_browser_allow_list_is_exact() -> None:
    assert frozenset(ALLOWED_BROWSER) == BROWSER_ALLOWED_COMMANDS


def _browser(command: Any) -> Verdict:
    return decide("agent_browser", {"command": command}, has_db_copy=True)


@pytest.mark.parametrize("command", ALLOWED_BROWSER)
def test_allowed_browser_commands(command: str) -> None:
    v = _browser(command)
    assert (v.decision, v.route, v.category) == (ALLOW, UP, "browser")
    assert repr(command) in v.reason


@pytest.mark.parametrize(
    "command",
    [
        "tab new",
        "TAB list",
        "get text @e1",
        "open https://example.com/jobs",
        "  Navigate   https://example.com",
        "is visible #submit",
        "wait --load networkidle",
        "screenshot out.png",
    ],
)
def test_browser_sub_commands_use_first_word(command: str) -> None:
    assert _browser(command).decision is ALLOW


@pytest.mark.parametrize("command", STUBBED_BROWSER)
def test_other_browser_commands_are_stubbed(command: str) -> None:
    v = _browser(command + " @e1")
    assert (v.decision, v.route, v.category) == (STUB, NONE, "browser")
    assert v.reason == f"browser command {command!r} can have effects"


@pytest.mark.parametrize("command", ["eval document.title", "EVAL 1+1", "eval"])
def test_browser_eval_is_stubbed_with_its_own_reason(command: str) -> None:
    v = _browser(command)
    assert (v.decision, v.reason) == (STUB, "JavaScript cannot be classified")


@pytest.mark.parametrize(
    "command",
    [
        "open javascript:document.forms[0].submit()",
        "goto 'JavaScript:alert(1)'",
        "tab new data:text/html,<form></form>",
        "wait --fn window.done",
        "wait --fn=window.done",
    ],
)
def test_browser_commands_carrying_javascript_are_stubbed(command: str) -> None:
    v = _browser(command)
    assert (v.decision, v.reason) == (STUB, "JavaScript cannot be classified")


@pytest.mark.parametrize("command", [None, "", "   ", 5, ["click"]])
def test_browser_missing_command_is_stubbed(command: Any) -> None:
    v = _browser(command)
    assert (v.decision, v.route) == (STUB, NONE)
    assert v.reason == "missing or empty browser command"


def test_browser_without_command_key_is_stubbed() -> None:
    assert decide("agent_browser", {}, has_db_copy=True).decision is STUB


def test_browser_stub_reply() -> None:
    v = _browser("click @e3")
    assert stub_reply("agent_browser", v.reason) == (
        "TEST MODE: agent_browser was NOT run (browser command 'click' can have effects). "
        "Continue as if it succeeded; do not look for another way to perform it."
    )


@pytest.mark.parametrize(
    "command",
    [
        "get url; click #x",
        "get url;click #x",
        "get url; eval document.title",
        "get url && click #x",
        "get url || click #x",
        "get url | click #x",
        "snapshot & click #x",
        "get url\nclick #x",
        "get url\r\nclick #x",
        "get url\tclick",
        "get text $(click #x)",
        "get text `click #x`",
        'get text "${x}"',
        "get text (click)",
        "screenshot > /tmp/x",
        "open 'unbalanced",
        'get text "unbalanced',
        "get text \\",
        "open https://example.com/?a=1&b=2",
    ],
)
def test_browser_command_that_is_not_exactly_one_command_is_stubbed(command: str) -> None:
    v = _browser(command)
    assert (v.decision, v.route, v.category) == (STUB, NONE, "browser")
    assert v.reason == "the browser command is not exactly one allowed command"


@pytest.mark.parametrize(
    "command",
    [
        'get text "a;b && c | d"',
        "get text 'x > y'",
        "open 'https://example.com/?a=1&b=2'",
        'is visible "#submit"',
        "get text a\\;b",
    ],
)
def test_browser_quoted_operators_are_argument_text(command: str) -> None:
    assert _browser(command).decision is ALLOW


@pytest.mark.parametrize(
    "command",
    [
        "open url=javascript:alert(1)",
        "open --url=JAVASCRIPT:alert(1)",
        "open vbscript:msgbox",
        'open "data:text/html,<script>x</script>"',
    ],
)
def test_browser_script_urls_anywhere_are_stubbed(command: str) -> None:
    v = _browser(command)
    assert (v.decision, v.reason) == (STUB, "JavaScript cannot be classified")
