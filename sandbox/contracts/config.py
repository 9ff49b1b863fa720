"""The workflow folder's configuration, parsed once from `workflow.toml`.

One pydantic model (`Workflow`) is the whole configuration; every other module
receives the parts it needs from it and reads no options on its own. A bad file
yields one `ConfigError` naming the file, the field and the problem. Every
field, including those only the guard uses (MCP servers, egress, the bridge
upstream), is validated at load, so a typo fails before any run starts.
"""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from sandbox.contracts.defaults import empty_list
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.guardparts import DEFAULT_LOOKUP_BUDGET_S as DEFAULT_LOOKUP_BUDGET_S
from sandbox.contracts.guardparts import Egress as Egress
from sandbox.contracts.guardparts import EgressEntry as EgressEntry
from sandbox.contracts.guardparts import Ident as Ident
from sandbox.contracts.guardparts import McpServer as McpServer
from sandbox.contracts.guardparts import Strict as _Strict
from sandbox.contracts.layout import RUN_ROOT_NAMES

WORKFLOW_FILE = "workflow.toml"


class Step(_Strict):
    """One workflow step: what runs, in which group folder, for how long.

    `needs` names the steps that must run before this one in a whole-workflow run
    (none given anywhere: the `[[steps]]` order). `kind = "crew"` is a Crew step: it
    acts in another project (`crew` names it), so test mode refuses it and never runs
    it; it has no command."""

    id: Ident = Field(
        description=("The step's name, unique in the workflow (`sandbox run WF ID`).")
    )
    group: Ident = Field(
        description=(
            "Its group folder: the run's writable working directory, seeded "
            "from the newest real run's execution tree. A name of the test run "
            "folder's own entries is refused."
        )
    )
    kind: Literal["command", "crew"] = Field(
        default="command",
        description=(
            "`command` runs `command`; `crew` is a Crew step, which acts in "
            "another project: test mode refuses it and never runs it."
        ),
    )
    command: str | list[str] | None = Field(
        default=None,
        description=(
            "What runs: a list is the argv, a string runs through `/bin/sh -c`."
            ' Required unless `kind = "crew"`.'
        ),
    )
    crew: Ident | None = Field(default=None, description="A Crew step's project name.")
    needs: list[Ident] = Field(
        default_factory=empty_list,
        description=(
            "Steps that run before this one in a whole-workflow run; without "
            "any `needs` anywhere, the `[[steps]]` order."
        ),
    )
    prompt_file: str | None = Field(
        default=None,
        description=(
            "The step's prompt, relative to the workflow folder; the step gets "
            "it with a `## TEST MODE` section added (`AGENTWORKS_PROMPT_FILE`)."
        ),
    )
    timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=24 * 3600,
        description=(
            "Seconds the step may run; past it the step is killed and the run is `timeout`."
        ),
    )
    # What a verification checks (`sandbox verify`): tables here, or a TOML file of
    # `[[expect]]` tables beside the workflow. Parsed and judged by `sandbox.verify`,
    # never by a test run, which does not read them.
    expect: list[dict[str, Any]] = Field(
        default_factory=empty_list,
        description=(
            "The step's expectations (`[[steps.expect]]` tables), judged by "
            "`sandbox verify`; a test run does not read them."
        ),
    )
    expect_file: str | None = Field(
        default=None,
        description=(
            "A TOML file of `[[expect]]` tables, relative to the workflow "
            "folder, instead of or beside `expect`."
        ),
    )

    @model_validator(mode="after")
    def _command_for_kind(self) -> Step:
        if self.kind == "command" and self.command is None:
            raise ValueError("command is missing (every step but a Crew step has one)")
        if self.kind == "crew" and self.command is not None:
            raise ValueError("a Crew step has no command (it calls its Crew project)")
        return self

    @field_validator("command")
    @classmethod
    def _command_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is None:
            return value
        if isinstance(value, str) and not value.strip():
            raise ValueError("command is empty")
        if isinstance(value, list) and (not value or not all(value)):
            raise ValueError("command list is empty or has an empty element")
        return value

    @field_validator("group")
    @classmethod
    def _not_a_run_root_name(cls, value: str) -> str:
        # The run folder holds the group folder beside its own files and folders; a group
        # of one of their names would be written over by, or write over, the run's own.
        # Compared case-insensitively so the refusal holds on any file system.
        clash = {name.casefold(): name for name in RUN_ROOT_NAMES}.get(value.casefold())
        if clash is not None:
            raise ValueError(
                f"group {value!r} clashes with the test run folder's own {clash!r}"
                f" (reserved there: {', '.join(sorted(RUN_ROOT_NAMES))})"
            )
        return value

    @field_validator("prompt_file", "expect_file")
    @classmethod
    def _relative_path(cls, value: str | None) -> str | None:
        if value is not None and (value.startswith("/") or ".." in Path(value).parts):
            raise ValueError("must be a path inside the workflow folder")
        return value

    def argv(self) -> list[str]:
        """The command as an argv list; a string runs through `/bin/sh -c`."""
        if self.command is None:
            raise ConfigError(f"step {self.id} is a Crew step: it has no command to run")
        if isinstance(self.command, list):
            return list(self.command)
        return ["/bin/sh", "-c", self.command]

    def display_command(self) -> str:
        if self.command is None:
            return f"crew {self.crew or '?'}"
        return self.command if isinstance(self.command, str) else shlex.join(self.command)


class CrewFolder(_Strict):
    """A Crew project's folder: mounted read-only; Crew calls themselves are refused."""

    name: Ident = Field(
        description=("The Crew project's name; mounted read-only at `/crew/<name>`.")
    )
    path: str = Field(
        description=("Its folder, absolute or relative to the workflow folder; it must exist.")
    )


class Bridge(_Strict):
    """The real bridge that allowed calls are forwarded to, with per-tool time budgets."""

    upstream: str | None = Field(
        default=None,
        description=(
            "The real bridge that allowed calls (model calls, reads) are "
            "forwarded to; none: allowed calls fail with a clear error."
        ),
    )
    # Existing Docker networks the guard joins to reach its upstreams.
    networks: list[str] = Field(
        default_factory=empty_list,
        description=("Existing Docker networks the guard joins to reach its upstreams."),
    )
    default_budget_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description=(
            "Seconds a forwarded call may take (plus `grace_s`) unless `budgets` names its tool."
        ),
    )
    grace_s: float = Field(
        default=10.0,
        ge=0,
        le=600,
        description=("Seconds added to every budget before the guard gives up on a call."),
    )
    budgets: dict[str, float] = Field(
        default_factory=dict,
        description=("Per-tool budgets in seconds, e.g. `{ generate_text_llm = 120 }`."),
    )


class Limits(_Strict):
    """Resource fences for one test run's containers."""

    memory_mb: int = Field(
        default=1024,
        ge=32,
        le=64 * 1024,
        description=(
            "The step container's memory limit; a step killed by it reads "
            "`memory limit of N MB reached`."
        ),
    )
    pids: int = Field(
        default=256,
        ge=16,
        le=32768,
        description=("The step container's process limit (at least 256 under gVisor)."),
    )
    cpus: float = Field(default=1.0, gt=0, le=64, description="CPUs the step container may use.")
    # Accepted and unused: the step's /tmp is a folder of its disk (disk_quota_mb).
    tmpfs_mb: int = Field(
        default=64,
        ge=1,
        le=4096,
        description=(
            "Accepted and unused: the step's `/tmp` is a folder of its disk (`disk_quota_mb`)."
        ),
    )
    copy_cap_mb: int = Field(
        default=512,
        ge=0,
        le=512,
        description=(
            "The most of the newest real run's execution tree copied into the "
            "group folder (MB); what is left out is listed in the record."
        ),
    )
    # The size of the step's disk: its group folder, its DB copy and its /tmp
    # together (the copies it starts with included); at the wall the step is stopped
    # and the run recorded as `quota`.
    disk_quota_mb: int = Field(
        default=2048,
        ge=1,
        le=1024 * 1024,
        description=(
            "The size of the step's disk: its group folder, DB copy and `/tmp` "
            "together. At the wall the step is stopped and the run is `quota`."
        ),
    )


StepRuntime = Literal["runc", "runsc"]


class Isolation(_Strict):
    """The walls around the step. `step_runtime = "runsc"` runs the step container
    under gVisor (a user-space kernel between the step and the host's); the guard
    and the MCP servers stay on runc (the firewall must see the guard's uid)."""

    step_runtime: StepRuntime = Field(
        default="runc",
        description=(
            "`runsc` runs the step under gVisor (the engine must register "
            "runsc); the guard and MCP servers stay on runc."
        ),
    )


# The folders the spec names as the workflow's data (its inputs and outputs, never its
# version); `[version] data` adds the workflow's own.
SPEC_DATA: tuple[str, ...] = ("db", "runs", "learnings", "knowledgebase", "planning")


class Version(_Strict):
    """What of the workflow folder is not part of a step's version (`sandbox.prepare
    .contenthash`): `data` lists paths (folders or files, relative to the workflow folder)
    that hold data, beside the spec's own data folders. Anything not listed is code: a
    new folder counts as code until it is declared here."""

    data: list[str] = Field(
        default_factory=empty_list,
        description=(
            "Paths (folders or files, relative to the workflow folder) that "
            "hold data and are not part of a step's version, beside the spec's "
            "`db/`, `runs/`, `learnings/`, `knowledgebase/`, `planning/`. "
            "Anything not listed is code."
        ),
    )

    @field_validator("data")
    @classmethod
    def _data_paths(cls, value: list[str]) -> list[str]:
        out = []
        for raw in value:
            parts = [p for p in raw.split("/") if p not in ("", ".")]
            if raw.startswith("/") or ".." in parts or not parts:
                raise ValueError(f"{raw!r}: must be a path inside the workflow folder")
            if parts == [WORKFLOW_FILE]:
                raise ValueError(f"{raw!r}: {WORKFLOW_FILE} is always part of the version")
            out.append("/".join(parts))
        return out


class Workflow(_Strict):
    """The whole `workflow.toml`."""

    name: Ident = Field(
        default="workflow", description="The workflow's name, shown in records and verdicts."
    )
    steps: list[Step] = Field(description="The steps (`[[steps]]`), in file order.")
    crew_folders: list[CrewFolder] = Field(
        default_factory=empty_list,
        description=("Other projects' folders the steps may read (`[[crew_folders]]`)."),
    )
    mcp_servers: list[McpServer] = Field(
        default_factory=empty_list,
        description=("MCP servers the step may reach through the guard (`[[mcp_servers]]`)."),
    )
    egress: Egress = Field(
        default_factory=Egress,
        description=("The step's way out to the network: the guard's proxy and its allow list."),
    )
    bridge: Bridge = Field(
        default_factory=Bridge,
        description="The real bridge allowed calls go to, and their time budgets.",
    )
    limits: Limits = Field(
        default_factory=Limits, description="Resource limits of the step's container and disk."
    )
    isolation: Isolation = Field(
        default_factory=Isolation, description="Second walls around the step."
    )
    version: Version = Field(
        default_factory=Version,
        description=("What of the workflow folder is data, not part of a step's version."),
    )

    @model_validator(mode="after")
    def _unique_names(self) -> Workflow:
        for label, names in (
            ("steps", [s.id for s in self.steps]),
            ("crew_folders", [c.name for c in self.crew_folders]),
            ("mcp_servers", [m.name for m in self.mcp_servers]),
        ):
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{label}: duplicate name(s) {', '.join(dupes)}")
        self.order()  # an unknown name in `needs` or a cycle fails the load
        return self

    def order(self) -> list[Step]:
        """The steps in the order a whole-workflow run takes them.

        Without any `needs` it is the `[[steps]]` order. With them, a step comes after
        every step it needs, and otherwise keeps its place in the file (the earliest
        declared ready step goes first), so the order is the same on every load.
        Raises ValueError for a `needs` entry that names no step, or a cycle."""
        ids = [s.id for s in self.steps]
        for step in self.steps:
            unknown = [n for n in step.needs if n not in ids]
            if unknown:
                raise ValueError(f"step {step.id}: needs unknown step(s) {', '.join(unknown)}")
            if step.id in step.needs:
                raise ValueError(f"step {step.id}: needs itself")
        done: list[Step] = []
        left = list(self.steps)
        while left:
            ready = next((s for s in left if all(n in {d.id for d in done} for n in s.needs)), None)
            if ready is None:
                cycle = ", ".join(s.id for s in left)
                raise ValueError(f"steps' needs form a cycle among: {cycle}")
            done.append(ready)
            left.remove(ready)
        return done

    def step(self, step_id: str) -> Step:
        for step in self.steps:
            if step.id == step_id:
                return step
        known = ", ".join(s.id for s in self.steps) or "none"
        raise ConfigError(f"unknown step {step_id!r} (this workflow has: {known})")


def _format_validation_error(path: Path, err: ValidationError) -> str:
    first = err.errors()[0]
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{path}: {loc or 'top level'}: {first['msg']}{more}"


def load_workflow(workflow_dir: Path) -> Workflow:
    """Parse `<workflow_dir>/workflow.toml`, or raise one readable ConfigError."""
    if not workflow_dir.is_dir():
        raise ConfigError(f"workflow folder not found: {workflow_dir}")
    path = workflow_dir / WORKFLOW_FILE
    if path.is_symlink() or not path.is_file():
        raise ConfigError(f"{path}: missing (every workflow folder has a {WORKFLOW_FILE})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        return Workflow.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(path, exc)) from None


def resolve_crew_folder(workflow_dir: Path, crew: CrewFolder) -> Path:
    """Crew paths may be relative to the workflow folder; they must exist as folders."""
    path = Path(crew.path)
    path = path if path.is_absolute() else (workflow_dir / path)
    path = path.resolve()
    if not path.is_dir():
        raise ConfigError(f"crew folder {crew.name!r} not found: {path}")
    return path
