"""workflow.toml parsing: good files load, bad ones give one clear line."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from sandbox.contracts.config import DEFAULT_LOOKUP_BUDGET_S, Egress, load_workflow
from sandbox.contracts.errors import ConfigError

GOOD = """
name = "jobs"
[[steps]]
id = "bid-submit"
group = "bids"
command = ["python3", "/workflow/code/submit.py"]
timeout_s = 30
[[crew_folders]]
name = "sales"
path = "../sales"
[[mcp_servers]]
name = "fs"
command = ["npx", "-y", "@modelcontextprotocol/server-filesystem", "/data"]
read_only_overrides = { write_file = false }
[egress]
allow = ["api.example.org", "*.cdn.example.org:443", { host = "models.example.org", model = true }]
[bridge]
upstream = "http://jobboard:8080"
budgets = { generate_text_llm = 120 }
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "workflow.toml").write_text(text)
    return tmp_path


def test_good_file_loads_every_section(tmp_path: Path) -> None:
    wf = load_workflow(write(tmp_path, GOOD))
    step = wf.step("bid-submit")
    assert step.argv() == ["python3", "/workflow/code/submit.py"]
    assert wf.mcp_servers[0].read_only_overrides == {"write_file": False}
    # The live lookup before each call gets the default budget unless the server sets one.
    assert wf.mcp_servers[0].lookup_budget_s == DEFAULT_LOOKUP_BUDGET_S
    hosts = [(e.host, e.port, e.model) for e in wf.egress.allow]
    assert hosts == [
        ("api.example.org", None, False),
        ("*.cdn.example.org", 443, False),
        ("models.example.org", None, True),
    ]
    assert wf.bridge.budgets == {"generate_text_llm": 120}


def test_string_command_runs_through_sh(tmp_path: Path) -> None:
    wf = load_workflow(write(tmp_path, '[[steps]]\nid="a"\ngroup="g"\ncommand="echo hi"\n'))
    assert wf.step("a").argv() == ["/bin/sh", "-c", "echo hi"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[[steps]]\nid='a'\ngroup='g'\ncommand=''\n",
            "steps[0].command: Value error, command is empty",
        ),
        ("[[steps]]\nid='a b'\ngroup='g'\ncommand='x'\n", "steps[0].id: String should match"),
        (
            "[[steps]]\nid='a'\ngroup='g'\ncommand='x'\ntimeout='1'\n",
            "steps[0].timeout: Extra inputs",
        ),
        ("steps = [", "not valid TOML"),
        (
            "[[steps]]\nid='a'\ngroup='g'\ncommand='x'\n[[mcp_servers]]\nname='m'\n",
            "mcp_servers[0]",
        ),
        (
            "[[steps]]\nid='a'\ngroup='g'\ncommand='x'\n[egress]\nallow=['bad host!']\n",
            "egress.allow[0].host",
        ),
        ("name='x'\n", "steps: Field required"),
        (
            "[[steps]]\nid='a'\ngroup='g'\ncommand='x'\n"
            "[[mcp_servers]]\nname='m'\ncommand=['m']\nlookup_budget_s=0\n",
            "mcp_servers[0].lookup_budget_s: Input should be greater than 0",
        ),
    ],
)
def test_bad_file_is_one_clear_error(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_workflow(write(tmp_path, text))
    message = str(info.value)
    assert str(tmp_path / "workflow.toml") in message
    assert expected in message
    assert "\n" not in message


def test_unknown_step_lists_the_known_ones(tmp_path: Path) -> None:
    wf = load_workflow(write(tmp_path, GOOD))
    with pytest.raises(ConfigError, match=r"unknown step 'nope' \(this workflow has: bid-submit\)"):
        wf.step("nope")


def _egress(text: str) -> Egress:
    return Egress.model_validate(tomllib.loads(text)["egress"])


def test_tls_is_inspected_by_default_with_a_per_host_opt_out() -> None:
    egress = _egress(
        """
[egress]
allow = ["a.example.org", { host = "b.example.org", inspect = false },
         { host = "c.example.org", port = 8443, tls = true }]
"""
    )
    assert [egress.inspects(e) for e in egress.allow] == [True, False, True]
    assert egress.needs_ca()


def test_an_old_inspect_tls_false_still_loads_and_keeps_its_tunnels_blind() -> None:
    egress = _egress(
        """
[egress]
inspect_tls = false
allow = ["a.example.org", { host = "b.example.org", inspect = true }]
"""
    )
    assert [egress.inspects(e) for e in egress.allow] == [False, True]
    assert _egress('[egress]\ninspect_tls = false\nallow = ["a.example.org"]').needs_ca() is False


def test_no_ca_when_no_entry_admits_an_inspected_connect() -> None:
    assert not _egress('[egress]\nallow = [{ host = "a.example.org", port = 8080 }]').needs_ca()
    assert not _egress("[egress]\nallow = []").needs_ca()


def _reserved_cases() -> list[str]:
    from sandbox.contracts.layout import RUN_ROOT_NAMES

    return [*sorted(RUN_ROOT_NAMES), "GUARD", "Db"]


@pytest.mark.parametrize("group", _reserved_cases())
def test_a_group_named_like_the_run_folders_own_entries_is_refused(
    tmp_path: Path, group: str
) -> None:
    """A group folder sits in the run folder beside the record, the action log, the
    guard's folder, the DB copy...: a group of one of their names is refused at load,
    before any run, with the clash named."""
    text = f"[[steps]]\nid='a'\ngroup={group!r}\ncommand='x'\n"
    with pytest.raises(ConfigError) as info:
        load_workflow(write(tmp_path, text))
    message = str(info.value)
    assert "steps[0].group" in message
    if not group.startswith("."):  # a leading dot is no group name at all
        assert f"clashes with the test run folder's own {group.lower()!r}" in message


def test_every_entry_a_run_layout_names_in_its_root_is_reserved(tmp_path: Path) -> None:
    """The reserved list is the layout's own: every path a run root holds is on it."""
    from sandbox.contracts.layout import RUN_ROOT_NAMES, RunLayout, WorkflowRunLayout

    layout = RunLayout(tmp_path, "test-x", "g")
    for name in dir(RunLayout):
        value = getattr(layout, name)
        if isinstance(value, Path) and layout.root in value.parents:
            first = value.relative_to(layout.root).parts[0]
            assert first in RUN_ROOT_NAMES or name == "group_dir", name
    chain = WorkflowRunLayout(tmp_path, "test-y")
    for name in ("record", "actions", "steps_dir"):
        assert getattr(chain, name).name in RUN_ROOT_NAMES
