"""The workflow folder's configuration, parsed once from `workflow.toml`.

One pydantic model (`Workflow`) is the whole configuration; every other module
receives the parts it needs from it and reads no options on its own. A bad file
yields one `ConfigError` naming the file, the field and the problem. Every
field, including those only the guard uses (MCP servers, egress, the bridge
upstream), is validated at load, so a typo fails before any run starts.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from sandbox.contracts.defaults import empty_list
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.layout import RUN_ROOT_NAMES

WORKFLOW_FILE = "workflow.toml"

_IDENT = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
Ident = Annotated[str, Field(pattern=_IDENT)]


class _Strict(BaseModel):
    """Unknown keys are errors: a misspelt option must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


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


_HOST_RE = re.compile(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$|^\[[0-9A-Fa-f:.]+\]$")


class EgressEntry(_Strict):
    """One allow-listed destination. Read-only (GET/HEAD, git's fetch) unless marked a model
    endpoint.

    Without a port it admits plain HTTP on 80 and CONNECT (HTTPS) on 443."""

    host: str = Field(
        description=(
            "A host name, `*.example.org` for its subdomains (not the apex), or"
            " a bracketed IP address. Matched case-insensitively."
        )
    )
    port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description=(
            "The one port allowed; without it, plain HTTP on 80 and HTTPS (CONNECT) on 443."
        ),
    )
    # An explicit port is for plain HTTP unless `tls` says it is an HTTPS port:
    # a CONNECT tunnel to a plain-HTTP port would carry methods the proxy cannot see.
    tls: bool = Field(
        default=False,
        description=(
            "The explicit `port` is an HTTPS port (CONNECT); else an explicit port is plain HTTP."
        ),
    )
    model: bool = Field(
        default=False, description="A model API: any method passes, logged as a model call."
    )
    # TLS to this host is inspected unless this says false (then the tunnel is blind
    # and every line for it says "method not seen"); unset follows `egress.inspect_tls`.
    inspect: bool | None = Field(
        default=None,
        description=(
            "`false`: CONNECTs to this host are blind tunnels (`method not "
            "seen` on every line). Unset: `inspect_tls` decides."
        ),
    )
    # A WebSocket is a two-way channel a method filter cannot judge: stubbed unless
    # the host opts in, and then relayed unjudged with every line naming it.
    websocket: bool = Field(
        default=False,
        description=(
            "`true`: a WebSocket upgrade to this host is relayed both ways, unjudged"
            " (every line of that connection says `websocket`); else it is stubbed."
        ),
    )

    @field_validator("host")
    @classmethod
    def _valid_host(cls, value: str) -> str:
        if not _HOST_RE.match(value):
            raise ValueError(f"not a host name or wildcard like *.example.org: {value!r}")
        return value.lower()


def _entries_from_strings(value: Any) -> Any:
    """Allow-list entries: `"host"` and `"host:port"` shorthands beside full tables."""
    if not isinstance(value, list):
        return value
    out: list[Any] = []
    for item in value:
        if isinstance(item, str):
            host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
            out.append({"host": host, "port": int(port)} if port.isdigit() else {"host": item})
        else:
            out.append(item)
    return out


class Egress(_Strict):
    """Allow list for the egress proxy; empty means no egress at all.

    `inspect_tls` is the default for entries that do not set `inspect`: true (TLS is
    inspected, so the method inside HTTPS is judged) unless the file says false,
    which makes the tunnels of every entry without its own `inspect` blind. A
    per-host `inspect = false` is the narrower opt-out. A stdio MCP server's own
    list is an Egress of its entries alone (`McpServer.own_egress`): inspected
    unless an entry opts out."""

    allow: list[EgressEntry] = Field(
        default_factory=empty_list,
        description=(
            'The allow list: entries as tables, or `"host"` / `"host:port"` '
            "strings. GET and HEAD to a listed host pass, and so does git's fetch "
            "(`POST .../git-upload-pack`); everything else is stubbed or refused. "
            "Empty: no egress at all."
        ),
    )
    inspect_tls: bool = Field(
        default=True,
        description=(
            "The default for entries without their own `inspect`: TLS is opened"
            " with the run's CA and each request inside judged."
        ),
    )
    # PEM files (relative to the workflow folder) of CAs the guard trusts for the
    # real hosts when it inspects TLS, besides the system's.
    trust_ca_files: list[str] = Field(
        default_factory=empty_list,
        description=(
            "PEM files (relative to the workflow folder) of CAs the guard "
            "trusts for real hosts it inspects, besides the system's."
        ),
    )

    def inspects(self, entry: EgressEntry) -> bool:
        """Whether the proxy opens this entry's TLS and judges the requests inside."""
        return self.inspect_tls if entry.inspect is None else entry.inspect

    def needs_ca(self) -> bool:
        """Some entry admits CONNECT and is inspected: the run needs its own CA."""
        return any(
            (entry.port is None or entry.tls) and self.inspects(entry) for entry in self.allow
        )

    @field_validator("allow", mode="before")
    @classmethod
    def _allow_shorthands(cls, value: Any) -> Any:
        return _entries_from_strings(value)


DEFAULT_LOOKUP_BUDGET_S = 5.0  # a server's live tools/list before each call


class McpServer(_Strict):
    """An MCP server the step may reach through the guard (stdio command or HTTP URL).

    A stdio server runs in a container of its own, with only its own `env` and
    `env_from_host` values; its only way out is the guard's egress proxy with its
    own `egress` allow list (empty: no network at all)."""

    name: Ident = Field(
        description=("The server's name: the step reaches it at `$AGENTWORKS_MCP_URL/<name>`.")
    )
    command: list[str] | None = Field(
        default=None,
        description=(
            "A stdio server's argv, run in a container of its own (give "
            "`command` or `url`, not both)."
        ),
    )
    url: str | None = Field(
        default=None,
        description=(
            "A streamable-HTTP server's URL, reached by the guard only (on a "
            "network in `[bridge] networks` or `--upstream-network`)."
        ),
    )
    # Literal values here are readable by the step (the workflow folder is mounted
    # read-only into it); put credentials in `env_from_host` instead.
    env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Literal environment values for a stdio server. The step can read "
            "them (the workflow folder is mounted into it): put credentials in "
            "`env_from_host`."
        ),
    )
    # Names of runner-environment variables handed to this server only.
    env_from_host: list[str] = Field(
        default_factory=empty_list,
        description=("Names of the runner's environment variables handed to this server only."),
    )
    # Per-connection owner overrides: tool name -> read-only (true) or not (false).
    read_only_overrides: dict[str, bool] = Field(
        default_factory=dict,
        description=(
            "The owner's override per tool: `true` runs it as a read, `false` "
            "stubs it, whatever the server's annotations say."
        ),
    )
    # The time the guard gives this server's live tools/list before each call (and the
    # step's own listings twice that). A server that starts a process per request
    # (supergateway's stateless mode) may need more; a lookup past it stubs the call.
    lookup_budget_s: float = Field(
        default=DEFAULT_LOOKUP_BUDGET_S,
        gt=0,
        le=120,
        description=(
            "Seconds the guard gives the server's live `tools/list` before each"
            " call; a lookup past it stubs the call."
        ),
    )
    # What a stdio server may reach, through the guard's egress proxy (the same
    # entry shapes as [egress] allow, judged by the same rules); never the step's list.
    egress: list[EgressEntry] = Field(
        default_factory=empty_list,
        description=(
            "What a stdio server may reach through the guard's proxy (the entry"
            " shapes of `[egress] allow`); empty: no network. Never the step's "
            "list."
        ),
    )

    @field_validator("egress", mode="before")
    @classmethod
    def _egress_shorthands(cls, value: Any) -> Any:
        return _entries_from_strings(value)

    def own_egress(self) -> Egress:
        """This server's allow list as its egress proxy judges it: the step's rules
        (TLS inspected unless an entry says `inspect = false`), never the step's list."""
        return Egress(allow=self.egress)

    @model_validator(mode="after")
    def _one_transport(self) -> McpServer:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command (stdio) or url (streamable HTTP)")
        if self.command is not None and not self.command:
            raise ValueError("command is empty")
        if self.url is not None and self.egress:
            raise ValueError("egress is for stdio servers (the guard reaches a url server itself)")
        return self


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
