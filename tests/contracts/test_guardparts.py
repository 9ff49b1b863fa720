"""The guard builds only the config models it reads: its start-up is on every run's
critical path (the step's executor waits for it to listen), and the workflow's and the
host's whole config models are CPU it never needs. Checked through `sys.modules` in a
fresh interpreter, never by timing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from sandbox.contracts import config, guardparts, hostconfig

# The workflow's whole config (Workflow, Step, Limits...), the host's (with the runner's
# settings and image names): the runner's, never the guard's.
NOT_FOR_THE_GUARD = (
    "sandbox.contracts.config",
    "sandbox.contracts.hostconfig",
    "sandbox.contracts.settings",
)


def test_the_guards_start_up_builds_neither_the_workflows_nor_the_hosts_config() -> None:
    code = textwrap.dedent(
        """
        import json, sys
        import sandbox.guard.startup
        print(json.dumps(sorted(sys.modules)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = set(json.loads(done.stdout))
    assert "sandbox.contracts.guardparts" in loaded  # the check sees real imports
    assert [name for name in NOT_FOR_THE_GUARD if name in loaded] == []


def test_the_workflow_validates_the_guards_parts_with_the_same_models() -> None:
    # One source of truth: the runner's names are the guard's models.
    assert config.Egress is guardparts.Egress
    assert config.McpServer is guardparts.McpServer
    assert config.EgressEntry is guardparts.EgressEntry
    assert hostconfig.DEFAULT_DURABILITY == guardparts.DEFAULT_DURABILITY
    workflow = config.Workflow.model_validate(
        {
            "name": "wf",
            "steps": [{"id": "s", "group": "g", "command": ["true"]}],
            "egress": {"allow": ["Example.org", "api.example.org:8443"]},
            "mcp_servers": [{"name": "t", "command": ["srv"], "egress": ["pypi.org"]}],
        }
    )
    assert [entry.host for entry in workflow.egress.allow] == ["example.org", "api.example.org"]
    assert workflow.mcp_servers[0].own_egress().allow[0].host == "pypi.org"
