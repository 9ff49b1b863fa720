"""A whole-workflow run's order: `[[steps]]`, or `needs`; a cycle or unknown name fails the load."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import jsonschema
import pytest

from sandbox.contracts.config import load_workflow
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.workflow_record import (
    WORKFLOW_SCHEMA_PATH,
    workflow_record_json_schema,
)
from sandbox.run.workflowrun import chain_of


def _workflow(tmp_path: Path, steps: str) -> Path:
    (tmp_path / "workflow.toml").write_text(textwrap.dedent(steps))
    return tmp_path


def _step(step_id: str, needs: list[str] | None = None) -> str:
    line = f"needs = {json.dumps(needs)}\n" if needs is not None else ""
    return f'[[steps]]\nid = "{step_id}"\ngroup = "g"\ncommand = "true"\n{line}'


def test_order_is_the_files_order_without_needs(tmp_path: Path) -> None:
    wf = load_workflow(_workflow(tmp_path, _step("c") + _step("a") + _step("b")))
    assert [s.id for s in wf.order()] == ["c", "a", "b"]


def test_needs_put_a_step_after_what_it_needs_and_keep_the_rest_in_place(tmp_path: Path) -> None:
    text = _step("submit", ["pick"]) + _step("pick") + _step("outreach", ["submit"]) + _step("x")
    wf = load_workflow(_workflow(tmp_path, text))
    assert [s.id for s in wf.order()] == ["pick", "submit", "outreach", "x"]


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        (_step("a", ["b"]) + _step("b", ["a"]), "cycle"),
        (_step("a", ["a"]), "needs itself"),
        (_step("a", ["nope"]), "unknown step(s) nope"),
    ],
)
def test_a_cycle_or_an_unknown_name_is_a_config_error(
    tmp_path: Path, steps: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_workflow(_workflow(tmp_path, steps))


def test_from_and_to_cut_the_order(tmp_path: Path) -> None:
    wf = load_workflow(_workflow(tmp_path, _step("a") + _step("b") + _step("c") + _step("d")))
    assert [s.id for s in chain_of(wf, "b", "c")] == ["b", "c"]
    assert [s.id for s in chain_of(wf, "c", None)] == ["c", "d"]
    assert [s.id for s in chain_of(wf, None, "a")] == ["a"]
    with pytest.raises(ConfigError, match="comes before"):
        chain_of(wf, "c", "b")
    with pytest.raises(ConfigError, match="unknown step"):
        chain_of(wf, "zz", None)


def test_a_crew_step_has_no_command_and_a_command_step_needs_one(tmp_path: Path) -> None:
    wf = load_workflow(
        _workflow(tmp_path, '[[steps]]\nid = "c"\ngroup = "g"\nkind = "crew"\ncrew = "other"\n')
    )
    assert wf.steps[0].kind == "crew"
    with pytest.raises(ConfigError, match="command is missing"):
        load_workflow(_workflow(tmp_path, '[[steps]]\nid = "a"\ngroup = "g"\n'))
    with pytest.raises(ConfigError, match="no command"):
        load_workflow(
            _workflow(tmp_path, '[[steps]]\nid = "a"\ngroup = "g"\nkind = "crew"\ncommand = "x"\n')
        )


def test_committed_workflow_schema_matches_the_model() -> None:
    assert WORKFLOW_SCHEMA_PATH.read_text() == workflow_record_json_schema(), (
        "regenerate with: python -c 'from sandbox.contracts.workflow_record import *; "
        "WORKFLOW_SCHEMA_PATH.write_text(workflow_record_json_schema())'"
    )
    jsonschema.Draft202012Validator.check_schema(json.loads(WORKFLOW_SCHEMA_PATH.read_text()))
