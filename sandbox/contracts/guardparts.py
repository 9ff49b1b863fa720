"""The parts of the workflow's configuration the guard reads: the egress allow list
and the MCP servers (with the base every config model shares), and the action log's
durability from the host's config.

`sandbox.contracts.config` re-exports them: the workflow file is validated as one
model (`Workflow`) there. They live here so the guard, whose start-up is on every
run's critical path (the step waits for it to listen), builds only these models and
not the whole workflow's and host's (`tests/contracts/test_guardparts.py`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sandbox.contracts.defaults import empty_list

_IDENT = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
Ident = Annotated[str, Field(pattern=_IDENT)]


class Strict(BaseModel):
    """Unknown keys are errors: a misspelt option must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_HOST_RE = re.compile(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$|^\[[0-9A-Fa-f:.]+\]$")


class EgressEntry(Strict):
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


class Egress(Strict):
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


class McpServer(Strict):
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


# How the guard syncs the action log (sandbox/guard/actionlog.spec.md). "group": each
# line is written before its call goes on and synced in group commit off the request
# path, and the runner syncs the log when it seals the record. "per-call": each line is
# also synced before its call goes on (same-host durability, at a sync per call).
Durability = Literal["group", "per-call"]
DEFAULT_DURABILITY: Durability = "group"
