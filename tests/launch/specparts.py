"""A run's plan made to order (pure), the input every container spec is built from:
for the spec tests and for those that read a spec's labels. A helper, not a test
module, so no test file imports another."""

from __future__ import annotations

from pathlib import Path

from sandbox.contracts.config import Workflow
from sandbox.contracts.layout import RunLayout
from sandbox.contracts.record import RunnerInfo
from sandbox.launch import specs as launch


def plan(tmp_path: Path, **overrides: object) -> launch.RunPlan:
    workflow = Workflow.model_validate(
        {"name": "wf", "steps": [{"id": "s", "group": "g", "command": "true"}]}
    )
    values: dict[str, object] = {
        "workflow_dir": tmp_path,
        "workflow": workflow,
        "step": workflow.step("s"),
        "layout": RunLayout(tmp_path, "test-1", "g"),
        "runner": RunnerInfo(pid=1, create_time=1.0, hostname="h"),
        "crew": {"sales": tmp_path / "sales"},
        "has_db": True,
        "has_prompt": False,
        "seccomp_profile": "{}",
        "upstream": "http://up:8080",
        "networks": ["net-a", "net-b"],
        "egress": workflow.egress,
        "trusted_ca_pem": "",
        "mcp_host_env": {},
    }
    values.update(overrides)
    return launch.RunPlan(**values)  # type: ignore[arg-type]
