"""Expectations: what one step must (and must not) try in a test run, as pydantic models.

They live beside the step in `workflow.toml` (`[[steps.expect]]` tables) or in a
TOML file the step names (`expect_file`, holding `[[expect]]` tables). Every
table has a `kind`:

- `call`: a guarded call with this tool (a bridge tool, `mcp:<server>/<tool>`, or
  egress `method` + `host`), its arguments matched, counted (`count` exactly,
  `at_least`, `at_most`; at least once when none is given), and optionally after
  the calls of another expectation (`after = "<name>"`). By default only calls that
  would have run (stubbed) count; `decision` says otherwise.
- `no_call`: no call like this was tried at all, whatever the guard decided.
- `db`: rows of one table inserted / updated / deleted with given column values.
- `no_other_db_changes`: the DB diff holds nothing the `db` expectations did not match.
- `file`: a file of the group folder created / changed / deleted / left alone, its
  content matched (substring, regex, JSON path).
- `status`: the run's status and exit code.

A file that does not parse, or a table that does not validate, is a `ConfigError`
naming the file, the line and the field: an expectation is never silently dropped.
The published JSON Schema of one file is `sandbox/contracts/expectations.schema.json`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

from sandbox.contracts.config import WORKFLOW_FILE, Step, Workflow
from sandbox.contracts.errors import ConfigError

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "contracts" / "expectations.schema.json"
MAX_EXPECT_FILE_BYTES = 1024 * 1024
_PATH_TOKEN = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\[(\d+)\]|\[\"([^\"]*)\"\]|\['([^']*)'\]")


def parse_json_path(path: str) -> list[str | int]:
    """`$.a.b[0]["c d"]` (the `$` optional) -> ["a", "b", 0, "c d"]; ValueError if not."""
    text = path.strip()
    text = text[1:] if text.startswith("$") else text
    if text and not text.startswith(("[", ".")):
        text = "." + text
    out: list[str | int] = []
    pos = 0
    while pos < len(text):
        found = _PATH_TOKEN.match(text, pos)
        if found is None:
            raise ValueError(f"not a JSON path like $.a.b[0]: {path!r}")
        name, index, dq, sq = found.groups()
        out.append(int(index) if index is not None else (name or dq or sq or ""))
        pos = found.end()
    return out


class _Strict(BaseModel):
    """Unknown keys are errors: a misspelt matcher must never pass silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Match(_Strict):
    """One matcher on a JSON value (a call's arguments, a file's content, a column).

    `path` selects a part first (a JSON path; none: the whole value). Then exactly one
    test: `equals` (the same JSON value), `subset` (an object holding at least these
    keys with these values, recursively), `regex` (a string searched), `contains` (a
    substring of a string), or `exists` (the path is there, or not)."""

    path: str | None = None
    equals: JsonValue = None
    subset: dict[str, JsonValue] | None = None
    regex: str | None = None
    contains: str | None = None
    exists: bool | None = None

    @field_validator("path")
    @classmethod
    def _valid_path(cls, value: str | None) -> str | None:
        if value is not None:
            parse_json_path(value)
        return value

    @field_validator("regex")
    @classmethod
    def _valid_regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return value

    @model_validator(mode="after")
    def _one_test(self) -> Match:
        tests = [
            k
            for k in ("equals", "subset", "regex", "contains", "exists")
            if k in self.model_fields_set
        ]
        if len(tests) != 1:
            raise ValueError(
                "give exactly one of equals, subset, regex, contains, exists"
                + (f" (got {', '.join(tests)})" if tests else "")
            )
        return self

    def describe(self) -> str:
        where = self.path or "$"
        if "equals" in self.model_fields_set:
            return f"{where} == {json.dumps(self.equals)}"
        if self.subset is not None:
            return f"{where} has {json.dumps(self.subset, sort_keys=True)}"
        if self.regex is not None:
            return f"{where} ~ /{self.regex}/"
        if self.contains is not None:
            return f"{where} contains {json.dumps(self.contains)}"
        return f"{where} {'exists' if self.exists else 'is absent'}"


class _Counted(_Strict):
    """How many: `count` exactly, or `at_least` / `at_most`; at least one when none is given."""

    count: int | None = Field(default=None, ge=0)
    at_least: int | None = Field(default=None, ge=0)
    at_most: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one_count(self) -> _Counted:
        if self.count is not None and (self.at_least is not None or self.at_most is not None):
            raise ValueError("give count, or at_least/at_most, not both")
        if self.at_least is not None and self.at_most is not None and self.at_least > self.at_most:
            raise ValueError("at_least is more than at_most")
        return self

    def bounds(self) -> tuple[int, int | None]:
        if self.count is not None:
            return self.count, self.count
        if self.at_least is None and self.at_most is None:
            return 1, None
        return self.at_least or 0, self.at_most

    def describe_count(self) -> str:
        low, high = self.bounds()
        if low == high:
            return f"exactly {low} time(s)"
        if high is None:
            return f"at least {low} time(s)"
        return f"at most {high} time(s)" if low == 0 else f"{low} to {high} time(s)"


class _CallShape(_Strict):
    """Which calls: a tool name, or egress by `method` and `host` (tool `http`)."""

    name: str | None = None
    tool: str | None = None
    method: str | None = None
    host: str | None = None
    args: list[Match] = Field(default_factory=list)

    @model_validator(mode="after")
    def _tool_or_host(self) -> _CallShape:
        if self.tool is None and self.host is None and self.method is None:
            raise ValueError("give tool, or method and/or host for egress")
        if (self.host is not None or self.method is not None) and self.tool not in (None, "http"):
            raise ValueError("method and host are for egress calls (tool http)")
        return self

    @property
    def tool_name(self) -> str:
        return self.tool or "http"

    def describe_call(self) -> str:
        what = self.tool_name
        if self.method is not None or self.host is not None:
            what = f"egress {self.method or '*'} {self.host or '*'}"
        if self.args:
            what += " with " + " and ".join(m.describe() for m in self.args)
        return what


class InSteps(_Strict):
    """A whole chain's call expectation: `steps` counts only those steps' calls (none:
    every step's)."""

    steps: list[str] = Field(default_factory=list)

    def describe_steps(self) -> str:
        return f" (in step {', '.join(self.steps)})" if self.steps else " (across the chain)"


class CallExpectation(_CallShape, _Counted):
    kind: Literal["call"]
    decision: Literal["stub", "allow", "redirect", "refuse", "any"] = "stub"
    after: str | None = None

    def describe(self) -> str:
        verb = "would have run" if self.decision == "stub" else f"called ({self.decision})"
        text = f"{self.describe_call()} {verb} {self.describe_count()}"
        return text + (f", after {self.after!r}" if self.after else "")


class NoCallExpectation(_CallShape):
    kind: Literal["no_call"]

    def describe(self) -> str:
        return f"{self.describe_call()} is never tried"


class DbExpectation(_Counted):
    kind: Literal["db"]
    name: str | None = None
    table: str
    change: Literal["inserted", "updated", "deleted", "any"] = "any"
    # Column -> value (equal) or a matcher table. An updated row is matched on its key
    # and its new values.
    where: dict[str, Match | JsonValue] = Field(default_factory=dict)

    @field_validator("where", mode="before")
    @classmethod
    def _tables_are_matchers(cls, value: Any) -> Any:
        """A table is a matcher (`{ regex = "..." }`); compare an object column with
        `{ equals = {...} }`."""
        if isinstance(value, dict):
            return {
                k: Match.model_validate(v) if isinstance(v, dict) else v for k, v in value.items()
            }
        return value

    def describe(self) -> str:
        what = "changed" if self.change == "any" else self.change
        cond = ""
        if self.where:
            cond = " with " + ", ".join(
                v.describe().replace("$", k, 1) if isinstance(v, Match) else f"{k}={json.dumps(v)}"
                for k, v in self.where.items()
            )
        return f"{self.table}: rows{cond} {what} {self.describe_count()}"


class NoOtherDbChanges(_Strict):
    kind: Literal["no_other_db_changes"]
    name: str | None = None

    def describe(self) -> str:
        return "no DB change other than the expected ones"


class FileExpectation(_Strict):
    kind: Literal["file"]
    name: str | None = None
    path: str
    change: Literal["created", "changed", "deleted", "written", "untouched"] = "written"
    content: list[Match] = Field(default_factory=list)

    @field_validator("path")
    @classmethod
    def _inside(cls, value: str) -> str:
        parts = Path(value).parts
        if not value or value.startswith("/") or ".." in parts:
            raise ValueError("must be a path inside the group folder")
        return Path(value).as_posix()

    @model_validator(mode="after")
    def _content_needs_file(self) -> FileExpectation:
        if self.content and self.change in ("deleted", "untouched"):
            raise ValueError("content is checked only on a file the step wrote")
        return self

    def describe(self) -> str:
        what = "created or changed" if self.change == "written" else self.change
        text = f"file {self.path} {what}"
        if self.content:
            text += ", content " + " and ".join(m.describe() for m in self.content)
        return text


class StatusExpectation(_Strict):
    kind: Literal["status"]
    name: str | None = None
    status: Literal["passed", "failed", "timeout", "refused", "error", "killed", "quota"] = "passed"
    exit_code: int | None = None

    def describe(self) -> str:
        code = f", exit code {self.exit_code}" if self.exit_code is not None else ""
        return f"status {self.status}{code}"


Expectation = Annotated[
    CallExpectation
    | NoCallExpectation
    | DbExpectation
    | NoOtherDbChanges
    | FileExpectation
    | StatusExpectation,
    Field(discriminator="kind"),
]


class ExpectationFile(_Strict):
    """A file of expectations (`expect_file`): `[[expect]]` tables."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="ExpectationFile")

    expect: list[Expectation]


class Named(BaseModel):
    """One expectation with the label a verdict line uses."""

    model_config = ConfigDict(frozen=True)

    label: str
    expectation: Expectation


def expectations_json_schema() -> str:
    """The published schema text; a test pins the committed file to it."""
    return json.dumps(ExpectationFile.model_json_schema(), indent=2, sort_keys=True) + "\n"


# --------------------------------------------------------------------------- loading


def _block(lines: list[str], start: int, header: re.Pattern[str]) -> list[int]:
    """Indices of the lines opening each `header` table from `start` on, up to the next
    table that is not one of them or a sub-table of them."""
    found: list[int] = []
    for index in range(start, len(lines)):
        text = lines[index].strip()
        if header.match(text):
            found.append(index)
    return found


def _line_of(text: str, step_index: int | None, entry: int, loc: tuple[Any, ...]) -> int:
    """The 1-based line of `loc` in the `entry`th expectation table (best effort: the
    field's own line, else its table's header, else 1)."""
    lines = text.splitlines()
    start, end = 0, len(lines)
    if step_index is not None:
        steps = _block(lines, 0, re.compile(r"^\[\[\s*steps\s*\]\]"))
        if step_index >= len(steps):
            return 1
        start = steps[step_index]
        later = [i for i in steps if i > start]
        tops = [
            i
            for i in range(start + 1, len(lines))
            if lines[i].strip().startswith("[")
            and not re.match(r"^\[\[?\s*steps\.", lines[i].strip())
        ]
        end = min([*later, *tops, len(lines)])
        header = re.compile(r"^\[\[\s*steps\s*\.\s*expect\s*\]\]")
    else:
        header = re.compile(r"^\[\[\s*expect\s*\]\]")
    tables = [i for i in _block(lines, start, header) if i < end]
    if entry >= len(tables):
        # Inline `expect = [...]`: the line of the key.
        for index in range(start, end):
            if re.match(r"^\s*expect\s*=", lines[index]):
                return index + 1
        return start + 1
    first = tables[entry]
    stop = next(
        (i for i in range(first + 1, end) if lines[i].strip().startswith("[")),
        end,
    )
    key = next((str(part) for part in loc if isinstance(part, str)), None)
    if key is not None:
        pattern = re.compile(rf"^\s*\"?{re.escape(key)}\"?\s*=")
        for index in range(first + 1, stop):
            if pattern.match(lines[index]):
                return index + 1
    return first + 1


_KNOWN_FIELDS = sorted(
    {
        name
        for model in (
            CallExpectation,
            NoCallExpectation,
            DbExpectation,
            NoOtherDbChanges,
            FileExpectation,
            StatusExpectation,
            Match,
            InSteps,
        )
        for name in model.model_fields
    }
    | {"own", "id"}
)


_KINDS = frozenset({"call", "no_call", "db", "no_other_db_changes", "file", "status"})


def _explain(err: ValidationError) -> tuple[tuple[Any, ...], str]:
    errors = err.errors()
    # A misspelt key also makes the real one "missing": name the typo first.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = tuple(first["loc"])
    msg = first["msg"]
    if first["type"] == "extra_forbidden" and loc:
        near = difflib.get_close_matches(str(loc[-1]), _KNOWN_FIELDS, n=1)
        msg = "unknown field" + (f" (did you mean {near[0]!r}?)" if near else "")
    elif first["type"] == "missing" and loc:
        msg = "missing (required)"
    elif first["type"] in ("union_tag_invalid", "union_tag_not_found"):
        loc = (*loc, "kind")
    # The real key the typo stands for is "missing" too: that is the same mistake.
    rest = [
        e
        for e in errors
        if e is not first and not (e["type"] == "missing" and f"'{e['loc'][-1]}'" in msg)
    ]
    more = f" (and {len(rest)} more)" if rest else ""
    loc = loc[2:] if loc[:2] == ("expect", 0) else loc
    # Pydantic names the union member tried (e.g. `call`); the reader wrote a table.
    if loc and loc[0] in _KINDS:
        loc = loc[1:]
    return loc, msg + more


def _field_name(prefix: str, loc: tuple[Any, ...]) -> str:
    return prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)


def _validate(
    tables: list[Any],
    source: Path,
    text: str,
    step_index: int | None,
    prefix: str,
    container: type[BaseModel] | None = None,
) -> list[Any]:
    """Each table validated as one `expect` entry of `container` (a model whose only
    field is `expect`: a step's kinds by default)."""
    model = container or ExpectationFile
    out: list[Any] = []
    for index, table in enumerate(tables):
        try:
            validated: Any = model.model_validate({"expect": [table]})
            out.append(validated.expect[0])
        except ValidationError as exc:
            loc, msg = _explain(exc)
            line = _line_of(text, step_index, index, loc)
            field = _field_name(f"{prefix}[{index}]", loc)
            raise ConfigError(f"{source} line {line}: {field}: {msg}") from None
    return out


def _read_text(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot open: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(MAX_EXPECT_FILE_BYTES + 1)
    if len(data) > MAX_EXPECT_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_EXPECT_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None


def load_expectations(workflow_dir: Path, workflow: Workflow, step: Step) -> list[Named]:
    """Every expectation of `step`, labelled; ConfigError naming line and field if any
    does not validate, and if the step has none (a verification of nothing proves nothing)."""
    found: list[Expectation] = []
    if step.expect:
        path = workflow_dir / WORKFLOW_FILE
        text = _read_text(path)
        index = next(i for i, s in enumerate(workflow.steps) if s.id == step.id)
        found += _validate(step.expect, path, text, index, f"steps[{step.id}].expect")
    if step.expect_file is not None:
        path = workflow_dir / step.expect_file
        text = _read_text(path)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        unknown = sorted(set(data) - {"expect"})
        if unknown:
            raise ConfigError(f"{path} line 1: {unknown[0]}: unknown field (expected [[expect]])")
        tables = data.get("expect", [])
        if not isinstance(tables, list):
            raise ConfigError(f"{path}: expect: must be [[expect]] tables")
        found += _validate(tables, path, text, None, "expect")
    if not found:
        raise ConfigError(
            f"step {step.id} has no expectations: add [[steps.expect]] tables to "
            f"{WORKFLOW_FILE} or name a file with expect_file"
        )
    return labelled(found, f"step {step.id}")


def labelled(found: list[Expectation], where: str) -> list[Named]:
    """Each expectation with its label; ConfigError for a name used twice or an `after`
    that names no expectation of the same list (`where` says which list)."""
    names = [e.name for e in found if e.name]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{where}: expectation name(s) used twice: {', '.join(dupes)}")
    for e in found:
        if isinstance(e, CallExpectation) and e.after is not None and e.after not in names:
            raise ConfigError(
                f"{where}: expectation {e.name or e.describe()!r}: after names no "
                f"expectation ({e.after!r}; named: {', '.join(names) or 'none'})"
            )
    return [Named(label=e.name or e.describe(), expectation=e) for e in found]


def expectations_digest(named: list[Named]) -> str:
    """What was checked, as one hash: a verification counts only for the same expectations."""
    text = json.dumps(
        [n.expectation.model_dump(mode="json") for n in named], sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()
