"""A whole workflow's expectations: per step, and for the chain as one test run.

One TOML file (`sandbox verify-workflow WORKFLOW FILE`), relative to the
workflow folder or absolute:

- `[[steps]]` tables name a step of the chain (`id`) and what it must do there:
  `own = true` takes the step's own expectations (its `[[steps.expect]]` in
  `workflow.toml` or its `expect_file`), and `[[steps.expect]]` tables add more,
  of the same kinds a single step's verification has. They are judged against
  that step's test run inside the chain (its DB diff is against the copy the step
  before it left, so a row an earlier step inserted is `updated` here).
- `[[expect]]` tables are the chain's: `call` and `no_call` counted across every
  step's action-log lines (`steps = [...]` narrows them to some steps; `after`
  orders calls across steps), `db` and `no_other_db_changes` on the chain's DB
  diff (the real DB against the copy the chain left), `file` a file of a named
  `group` folder as the chain left it, and `status` the chain's status (it has no
  exit code). No expectation covers writes outside a step's group folder: each step
  mounts only its own group rw, so there are none to count.

Without a `status` expectation a step must pass, and so must the chain. A table
that does not validate is a ConfigError naming the file, the line and the field,
before anything runs. The published JSON Schema is
`sandbox/contracts/workflow_expectations.schema.json`.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from sandbox.contracts.config import Step, Workflow
from sandbox.contracts.errors import ConfigError
from sandbox.verify.expect import (
    CallExpectation,
    DbExpectation,
    Expectation,
    FileExpectation,
    InSteps,
    Named,
    NoCallExpectation,
    NoOtherDbChanges,
    StatusExpectation,
    _read_text,
    _Strict,
    _validate,
    expectations_digest,
    labelled,
    load_expectations,
)
from sandbox.verify.verifystep import with_implicit_status

SCHEMA_PATH = (
    Path(__file__).resolve().parents[1] / "contracts" / "workflow_expectations.schema.json"
)
IMPLICIT_CHAIN_STATUS = "the chain passed (no chain status expectation given)"


class ChainCallExpectation(CallExpectation, InSteps):
    def describe(self) -> str:
        return super().describe() + self.describe_steps()


class ChainNoCallExpectation(NoCallExpectation, InSteps):
    def describe(self) -> str:
        return super().describe() + self.describe_steps()


class ChainFileExpectation(FileExpectation):
    """A file of one group folder as the chain left it: created, changed or deleted
    against the seed of the chain (the newest real run), by whichever of the group's
    steps did it; its content read from the folder the last of them left."""

    group: str

    def describe(self) -> str:
        return (
            super()
            .describe()
            .replace(f"file {self.path}", f"file {self.path} in group {self.group}", 1)
            + " (as the chain left it)"
        )


class ChainStatusExpectation(StatusExpectation):
    """The chain's status: the worst of its steps' (a chain has no exit code)."""

    @model_validator(mode="after")
    def _no_exit_code(self) -> ChainStatusExpectation:
        if self.exit_code is not None:
            raise ValueError("a chain has no exit code: give it in a step's expectations")
        return self

    def describe(self) -> str:
        return f"chain status {self.status}"


ChainExpectation = Annotated[
    ChainCallExpectation
    | ChainNoCallExpectation
    | DbExpectation
    | NoOtherDbChanges
    | ChainFileExpectation
    | ChainStatusExpectation,
    Field(discriminator="kind"),
]


class _ChainTables(_Strict):
    expect: list[ChainExpectation]


class StepExpectations(_Strict):
    """`[[steps]]`: what one step of the chain must do there."""

    id: str
    own: bool = False
    expect: list[Expectation] = Field(default_factory=list)


class WorkflowExpectationFile(_Strict):
    """A workflow's expectations file: `[[steps]]` per step, `[[expect]]` for the chain."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="WorkflowExpectationFile")

    steps: list[StepExpectations] = Field(default_factory=list)
    expect: list[ChainExpectation] = Field(default_factory=list)


def workflow_expectations_json_schema() -> str:
    """The published schema text; a test pins the committed file to it."""
    return json.dumps(WorkflowExpectationFile.model_json_schema(), indent=2, sort_keys=True) + "\n"


@dataclass(frozen=True)
class StepPlan:
    """One step's expectations in the chain, and the digest of its own (when `own`),
    so `sandbox gate` for the step can count this verification."""

    step_id: str
    expectations: list[Named]
    own_digest: str | None = None


@dataclass(frozen=True)
class WorkflowExpectations:
    source: str  # the file as the verdict names it (relative to the workflow folder)
    steps: list[StepPlan]  # in the file's order
    chain: list[Named]
    digest: str

    def step(self, step_id: str) -> StepPlan | None:
        return next((s for s in self.steps if s.step_id == step_id), None)


def _with_chain_status(named: list[Named]) -> list[Named]:
    if any(isinstance(n.expectation, StatusExpectation) for n in named):
        return named
    implicit = ChainStatusExpectation(kind="status")
    return [*named, Named(label=IMPLICIT_CHAIN_STATUS, expectation=implicit)]


def digest_of(plans: list[StepPlan], chain: list[Named]) -> str:
    """What was checked, as one hash: a workflow verification counts only for these."""
    data = {
        "steps": {
            p.step_id: [n.expectation.model_dump(mode="json") for n in p.expectations]
            for p in plans
        },
        "chain": [n.expectation.model_dump(mode="json") for n in chain],
    }
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def resolve_file(workflow_dir: Path, path: Path | str) -> tuple[Path, str]:
    """The file to read, and its name as a verdict says it (relative when inside)."""
    given = Path(path)
    full = given if given.is_absolute() else workflow_dir / given
    try:
        shown = full.relative_to(workflow_dir).as_posix()
    except ValueError:
        shown = str(full)
    return full, shown


def load_workflow_expectations(
    workflow_dir: Path, workflow: Workflow, path: Path | str
) -> WorkflowExpectations:
    """Every expectation of the file, labelled and with the implicit statuses; a
    ConfigError naming line and field if any table does not validate, a step is
    unknown or named twice, or the file expects nothing."""
    full, shown = resolve_file(workflow_dir, path)
    text = _read_text(full)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{full}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"steps", "expect"})
    if unknown:
        raise ConfigError(
            f"{full} line 1: {unknown[0]}: unknown field (expected [[steps]] and [[expect]])"
        )
    steps_tables = data.get("steps", [])
    chain_tables = data.get("expect", [])
    if not isinstance(steps_tables, list) or not isinstance(chain_tables, list):
        raise ConfigError(f"{full}: steps and expect must be [[steps]] and [[expect]] tables")
    plans: list[StepPlan] = []
    seen: set[str] = set()
    for index, table in enumerate(steps_tables):
        plans.append(_step_plan(workflow_dir, workflow, full, text, index, table, seen))
    chain_found = _validate(chain_tables, full, text, None, "expect", _ChainTables)
    groups = {s.group for s in workflow.steps}
    for e in chain_found:
        if isinstance(e, InSteps):
            for step_id in e.steps:
                workflow.step(step_id)  # a ConfigError naming it when it is no step
        if isinstance(e, ChainFileExpectation) and e.group not in groups:
            raise ConfigError(
                f"{full}: expect: file {e.path}: group {e.group!r} is no step's group "
                f"({', '.join(sorted(groups))})"
            )
    if not plans and not chain_found:
        raise ConfigError(f"{full}: no expectations: add [[steps]] or [[expect]] tables")
    chain = _with_chain_status(labelled(chain_found, "the chain"))
    return WorkflowExpectations(
        source=shown, steps=plans, chain=chain, digest=digest_of(plans, chain)
    )


def _steps_line(text: str, index: int) -> int:
    """The 1-based line of the `index`th `[[steps]]` header (1 if it cannot be found)."""
    headers = [
        number
        for number, line in enumerate(text.splitlines(), start=1)
        if re.match(r"^\[\[\s*steps\s*\]\]", line.strip())
    ]
    return headers[index] if index < len(headers) else 1


def _step_plan(
    workflow_dir: Path,
    workflow: Workflow,
    full: Path,
    text: str,
    index: int,
    table: object,
    seen: set[str],
) -> StepPlan:
    at = f"{full} line {_steps_line(text, index)}"
    if not isinstance(table, dict):
        raise ConfigError(f"{at}: steps[{index}]: must be a [[steps]] table")
    extra = sorted(set(table) - {"id", "own", "expect"})
    if extra:
        raise ConfigError(
            f"{at}: steps[{index}].{extra[0]}: unknown field (a [[steps]] table takes "
            "id, own and [[steps.expect]] tables)"
        )
    step_id = table.get("id")
    if not isinstance(step_id, str):
        raise ConfigError(f"{at}: steps[{index}].id: missing (required): the step's id")
    try:
        step: Step = workflow.step(step_id)
    except ConfigError as exc:
        raise ConfigError(f"{at}: steps[{index}].id: {exc}") from None
    if step.id in seen:
        raise ConfigError(f"{at}: steps[{index}]: step {step.id} is named twice")
    seen.add(step.id)
    own = table.get("own", False)
    if not isinstance(own, bool):
        raise ConfigError(f"{at}: steps[{step.id}].own: must be true or false")
    tables = table.get("expect", [])
    if not isinstance(tables, list):
        raise ConfigError(f"{at}: steps[{step.id}].expect: must be [[steps.expect]] tables")
    found: list[Expectation] = _validate(tables, full, text, index, f"steps[{step.id}].expect")
    own_named: list[Named] = []
    own_digest = None
    if own:
        own_named = load_expectations(workflow_dir, workflow, step)
        own_digest = expectations_digest(with_implicit_status(own_named))
    elif not found:
        raise ConfigError(
            f"{at}: steps[{step.id}]: no expectations: set own = true or add "
            "[[steps.expect]] tables"
        )
    mine = [n.expectation for n in own_named]
    named = labelled([*mine, *found], f"{full}: steps[{step.id}]")
    return StepPlan(step.id, with_implicit_status(named), own_digest)
