"""A whole workflow made to order for the chain scenarios (steps that check they are in
test mode, a DB with one row, a real run's group folder), the one test run it leaves,
and its record checked against the published JSON Schema. A helper, not a test
module, so no test file imports another."""

from __future__ import annotations

import json
import sqlite3
import textwrap
from pathlib import Path

import jsonschema

from sandbox.contracts.layout import TEST_RUN_PREFIX
from sandbox.contracts.workflow_record import (
    WORKFLOW_SCHEMA_PATH,
    WorkflowRunRecord,
    read_any_record,
)

# Every step checks that it is in test mode, by its environment and by its prompt.
IN_TEST_MODE = """\
import json, os, pathlib, sqlite3, time, agentworks_bridge
assert os.environ["AGENTWORKS_TEST_MODE"] == "1", os.environ.get("AGENTWORKS_TEST_MODE")
assert "## TEST MODE" in pathlib.Path("/test/prompt.md").read_text()
db = sqlite3.connect(os.environ["DB_PATH"])
"""


def chain_workflow(
    root: Path,
    steps: list[tuple[str, str, str]],
    *,
    extra: str = "",
    name: str = "chain",
    timeout_s: int = 120,
    expect: str = "",
    preamble: str = IN_TEST_MODE,
) -> Path:
    """`<root>/<name>/`: a workflow whose steps (id, group, Python body after `preamble`)
    run in that order, each followed by the `expect` tables, `extra` at the end; a DB
    with one row, and a real run whose group folder `g` holds `earlier.txt`."""
    wf = root / name
    (wf / "code").mkdir(parents=True)
    (wf / "prompt.md").write_text("Do the step.\n")
    toml = [f'name = "{name}"']
    for step_id, group, body in steps:
        (wf / "code" / f"{step_id}.py").write_text(preamble + textwrap.dedent(body))
        toml.append(
            textwrap.dedent(
                f"""\
                [[steps]]
                id = "{step_id}"
                group = "{group}"
                command = ["python3", "/workflow/code/{step_id}.py"]
                prompt_file = "prompt.md"
                timeout_s = {timeout_s}
                """
            )
            + expect
        )
    (wf / "workflow.toml").write_text("\n".join(toml) + extra)
    (wf / "db").mkdir()
    con = sqlite3.connect(wf / "db" / "db.sqlite")
    con.executescript(
        "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT); INSERT INTO t VALUES (1, 'one');"
    )
    con.commit()
    con.close()
    execution = wf / "runs" / "run-1" / "g" / "execution"
    execution.mkdir(parents=True)
    (execution / "earlier.txt").write_text("real run")
    return wf


def the_run(wf: Path) -> Path:
    (root,) = [p for p in (wf / "runs").iterdir() if p.name.startswith(TEST_RUN_PREFIX)]
    return root


def validate(record_path: Path) -> WorkflowRunRecord:
    """The workflow record on disk, checked against the published JSON Schema."""
    data = json.loads(record_path.read_text())
    jsonschema.validate(data, json.loads(WORKFLOW_SCHEMA_PATH.read_text()))
    record = read_any_record(record_path.parent)
    assert isinstance(record, WorkflowRunRecord)
    return record
