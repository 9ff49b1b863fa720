"""A workflow's expectations file parses strictly, before anything runs; its schemas are published."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from sandbox.cli import main
from sandbox.contracts.config import load_workflow
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.record import FileChanges
from sandbox.verify.evidence import fold_changes
from sandbox.verify.workflow_expect import (
    SCHEMA_PATH,
    ChainCallExpectation,
    load_workflow_expectations,
    workflow_expectations_json_schema,
)
from sandbox.verify.workflow_verification import SCHEMA_PATH as VERDICT_SCHEMA_PATH
from sandbox.verify.workflow_verification import workflow_verification_json_schema
from tests import paths

REPO = paths.REPO
JOBBOARD = REPO / "examples" / "job-board"

WORKFLOW = """\
name = "wf"

[[steps]]
id = "pick"
group = "g"
command = "true"

[[steps.expect]]
kind = "status"

[[steps]]
id = "submit"
group = "g"
command = "true"
"""


def workflow_with(tmp_path: Path, chain_toml: str) -> Path:
    wf = tmp_path / "wf"
    wf.mkdir()
    (wf / "workflow.toml").write_text(WORKFLOW)
    (wf / "chain.toml").write_text(textwrap.dedent(chain_toml))
    return wf


def error_of(wf: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_workflow_expectations(wf, load_workflow(wf), "chain.toml")
    return str(info.value)


def test_committed_schemas_match_the_models() -> None:
    assert SCHEMA_PATH.read_text() == workflow_expectations_json_schema(), (
        "regenerate with: python -c 'from sandbox.verify.workflow_expect import *; "
        "SCHEMA_PATH.write_text(workflow_expectations_json_schema())'"
    )
    assert VERDICT_SCHEMA_PATH.read_text() == workflow_verification_json_schema(), (
        "regenerate with: python -c 'from sandbox.verify.workflow_verification import *; "
        "SCHEMA_PATH.write_text(workflow_verification_json_schema())'"
    )
    schema = json.loads(SCHEMA_PATH.read_text())
    chain_kinds = schema["properties"]["expect"]["items"]["discriminator"]["mapping"]
    assert set(chain_kinds) == {"call", "no_call", "db", "no_other_db_changes", "file", "status"}


def test_the_job_board_chain_file_loads_per_step_and_chain_expectations() -> None:
    workflow = load_workflow(JOBBOARD)
    loaded = load_workflow_expectations(JOBBOARD, workflow, "expect/chain.toml")
    assert loaded.source == "expect/chain.toml"
    assert [p.step_id for p in loaded.steps] == ["bid-pick-job", "bid-submit", "outreach"]
    # own = true takes the step's own expectations, and their digest for its gate.
    assert loaded.steps[0].own_digest is not None and loaded.steps[1].own_digest is None
    assert "messages Dana once" in [n.label for n in loaded.steps[2].expectations]
    labels = [n.label for n in loaded.chain]
    assert labels[-1] == "the chain passed (no chain status expectation given)"
    narrowed = next(n.expectation for n in loaded.chain if n.label.startswith("only outreach"))
    assert narrowed.describe() == (
        "send_slack_message is never tried (in step bid-pick-job, bid-submit)"
    )
    one = loaded.chain[0].expectation
    assert isinstance(one, ChainCallExpectation) and one.describe().endswith("(across the chain)")


def test_a_misspelt_chain_field_names_line_and_field(tmp_path: Path) -> None:
    wf = workflow_with(
        tmp_path,
        """\
        [[expect]]
        kind = "call"
        tool = "notify_user"
        cuont = 1
        """,
    )
    assert error_of(wf) == (
        f"{wf}/chain.toml line 4: expect[0].cuont: unknown field (did you mean 'count'?)"
    )


def test_a_misspelt_step_field_names_its_step_and_line(tmp_path: Path) -> None:
    wf = workflow_with(
        tmp_path,
        """\
        [[steps]]
        id = "submit"

        [[steps.expect]]
        kind = "db"
        tabel = "proposals"
        """,
    )
    assert error_of(wf).startswith(
        f"{wf}/chain.toml line 6: steps[submit].expect[0].tabel: unknown field"
    )


@pytest.mark.parametrize(
    ("chain_toml", "message"),
    [
        ('[[steps]]\nid = "nope"\nown = true\n', "nope"),
        ('[[steps]]\nid = "submit"\n', "steps[submit]: no expectations"),
        ('[[steps]]\nid = "submit"\nown = true\n', "step submit has no expectations"),
        (
            '[[steps]]\nid = "pick"\nown = true\n[[steps]]\nid = "pick"\nown = true\n',
            "line 4: steps[1]: step pick is named twice",
        ),
        ('[[steps]]\nid = "pick"\nonw = true\n', "line 1: steps[0].onw: unknown field"),
        ('own = 1\n[[steps]]\nid = "pick"\n', "line 1: own: unknown field"),
        ('[[expect]]\nkind = "status"\nexit_code = 0\n', "a chain has no exit code"),
        ('[[expect]]\nkind = "file"\npath = "x"\n', "expect[0].group: missing"),
        ('[[expect]]\nkind = "file"\npath = "x"\ngroup = "h"\n', "group 'h' is no step's group"),
        ('[[expect]]\nkind = "no_call"\ntool = "t"\nsteps = ["nope"]\n', "nope"),
        ("", "no expectations"),
        ('[[expect]]\nkind = "call"\ntool = "t"\nafter = "x"\n', "after names no expectation"),
    ],
)
def test_what_a_chain_file_cannot_say(tmp_path: Path, chain_toml: str, message: str) -> None:
    wf = workflow_with(tmp_path, chain_toml)
    assert message in error_of(wf)


def test_verify_workflow_with_a_bad_file_is_a_configuration_error_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wf = workflow_with(tmp_path, '[[expect]]\nkind = "call"\ntool = "t"\ncuont = 1\n')
    assert main(["verify-workflow", str(wf), "chain.toml"]) == 4
    assert "expect[0].cuont: unknown field" in capsys.readouterr().err
    assert not (wf / "runs").exists()  # nothing ran
    # A step the file names outside --from/--to: the same, before any run.
    (wf / "chain.toml").write_text('[[steps]]\nid = "pick"\nown = true\n')
    assert main(["verify-workflow", str(wf), "chain.toml", "--from", "submit"]) == 4
    assert "step(s) pick not in the chain (submit)" in capsys.readouterr().err
    assert not (wf / "runs").exists()


def test_gate_takes_a_step_or_a_workflow_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wf = workflow_with(tmp_path, '[[steps]]\nid = "pick"\nown = true\n')
    assert main(["gate", str(wf)]) == 2
    assert "give a step to gate, or --workflow FILE" in capsys.readouterr().err
    assert main(["gate", str(wf), "pick", "--workflow", "chain.toml"]) == 2
    assert main(["gate", str(wf), "pick", "--from", "pick"]) == 2


def test_a_group_folder_s_changes_fold_over_its_steps() -> None:
    """Against the chain's start: made then changed is created, made then deleted is
    gone, deleted then made again is changed; a capped list in any step caps them all."""
    folded = fold_changes(
        [
            FileChanges(created=["a", "b"], changed=["seed1"], deleted=["seed2"]),
            FileChanges(changed=["a", "seed1"], deleted=["b"], created=["seed2"]),
            FileChanges(deleted=["seed3"], truncated=True),
        ]
    )
    assert folded == FileChanges(
        created=["a"], changed=["seed1", "seed2"], deleted=["seed3"], truncated=True
    )
