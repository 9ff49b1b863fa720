"""What the runner tells the guard: one JSON document in a file of the guard's folder.

Not the environment: the guard's pid 1 (tini) and entry shell would keep an
environment readable by every process of the guard's uid, and the document holds
both tokens. The guard reads the file and removes it before it serves. MCP
servers' credentials are not in it: each stdio server gets its own in its own
container, and the guard never holds them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sandbox.contracts.defaults import empty_list
from sandbox.contracts.guardparts import DEFAULT_DURABILITY, Durability, Egress, McpServer
from sandbox.contracts.guardprocess import BRIDGE_PORT as BRIDGE_PORT
from sandbox.contracts.guardprocess import CONFIG_FILE_ENV as CONFIG_FILE_ENV
from sandbox.contracts.guardprocess import CONFIG_FILE_NAME as CONFIG_FILE_NAME
from sandbox.contracts.guardprocess import EGRESS_PORT as EGRESS_PORT
from sandbox.contracts.guardprocess import EXEC_PORT as EXEC_PORT
from sandbox.contracts.guardprocess import READY_MARK as READY_MARK
from sandbox.contracts.recording import RecordingSettings, ReplaySettings

ACTIONS_PATH = "/guard/actions.jsonl"
DATA_DIR = "/guard/data"  # the guard's own folder in the run root (0700, guard uid)
MCP_PATH = "/mcp"  # one streamable-HTTP endpoint per server: /mcp/<server name>
MCP_DIR = "/guard/mcp"  # the run's mcp/ folder: <MCP_DIR>/<server>/{mcp,egress}.sock


class GuardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    workflow: str
    step: str
    bridge_port: int = BRIDGE_PORT
    exec_port: int = EXEC_PORT
    bridge_token: str = Field(min_length=16)
    exec_token: str = Field(min_length=16)
    has_db: bool
    upstream: str | None = None
    default_budget_s: float = 30.0
    grace_s: float = 10.0
    budgets: dict[str, float] = Field(default_factory=dict)
    actions_path: str = ACTIONS_PATH
    data_dir: str = DATA_DIR
    durability: Durability = DEFAULT_DURABILITY  # host.toml's: how the action log syncs
    mcp_servers: list[McpServer] = Field(default_factory=empty_list)
    # Where each stdio server's sockets are (<mcp_dir>/<name>/), and the uid its
    # container runs as: the only peer its socket accepts.
    mcp_dir: str = MCP_DIR
    mcp_uids: dict[str, int] = Field(default_factory=dict)
    egress: Egress = Field(default_factory=Egress)
    egress_port: int = EGRESS_PORT
    # PEM text of CAs the guard trusts for real hosts besides the system's
    # (from the workflow's egress.trust_ca_files).
    egress_trust_pem: str = ""
    # The run's TLS-inspection CA, made by the runner (see sandbox.guard.egress.tls); empty
    # when no allow-list entry is inspected. The key is as secret as the tokens.
    egress_ca_pem: str = ""
    egress_ca_key_pem: str = Field(default="", repr=False)
    # The preflight's canaries (HOST:PORT): its own first packet to each is not the
    # step's attempt (sandbox.guard.egress.packets).
    preflight_canaries: list[str] = Field(default_factory=empty_list)
    # Every allowed read's answer kept (<data_dir>/recording/), and the recording this
    # run replays from (<data_dir>/replay/, copied in by the runner), if it replays.
    recording: RecordingSettings = Field(default_factory=RecordingSettings)
    replay: ReplaySettings | None = None

    def budget_for(self, tool: str) -> float:
        """The tool's time budget plus the grace window (the seed's +10 s rule)."""
        return self.budgets.get(tool, self.default_budget_s) + self.grace_s
