"""What the runner tells the guard, passed as one JSON document in its environment.

The guard runs in a separate pid namespace from the step, so its environment
(which holds both tokens) cannot be read from inside the step.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

CONFIG_ENV = "SANDBOX_GUARD_CONFIG"
BRIDGE_PORT = 8790
EXEC_PORT = 8799
ACTIONS_PATH = "/guard/actions.jsonl"


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
    fsync_each: bool = True

    def budget_for(self, tool: str) -> float:
        """The tool's time budget plus the grace window (the seed's +10 s rule)."""
        return self.budgets.get(tool, self.default_budget_s) + self.grace_s
