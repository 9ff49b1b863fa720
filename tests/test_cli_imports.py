"""The command a controller calls stays cheap to start: `sandbox run` loads the run's
modules and nothing a run does not need.

Checked in a fresh interpreter through `sys.modules` (what was imported), never by
timing: each module named here costs every CLI call its import, and none of them is
needed before (or during) a test run that has no TLS inspection and no DB.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Never needed by a Docker test run: the cluster client, terminal rendering, the MCP SDK
# (only the guard speaks MCP), the X.509 library (only a run that inspects TLS makes a
# CA), the leftover collector (`sandbox gc`), the DB diff (only a run with a DB), the
# step executor's own server and tools (they run inside the step container).
NOT_FOR_A_RUN = (
    "kubernetes",
    "rich",
    "mcp",
    "cryptography",
    "sandbox.backends.docker.gc",
    "sandbox.collect.dbdiff",
    "sandbox.guard.tls",
    "sandbox.policy",  # the guard judges calls; the runner only hashes the file
    "sandbox.stepside.agentworks_exec.server",
    "sandbox.stepside.agentworks_exec.supervisor",
)

# Not needed to parse the command line (nor by `sandbox show`/`list`): the engine's SDK.
NOT_FOR_THE_CLI_MODULE = (*NOT_FOR_A_RUN, "docker", "requests", "sandbox.run.testrun")


def loaded_after(*modules: str) -> set[str]:
    """The names in sys.modules of a new interpreter after importing `modules`."""
    code = textwrap.dedent(
        f"""
        import importlib, json, sys
        for name in {list(modules)!r}:
            importlib.import_module(name)
        print(json.dumps(sorted(sys.modules)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(done.stdout))


def present(loaded: set[str], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n in loaded or any(m.startswith(n + ".") for m in loaded)]


def test_importing_the_cli_loads_no_engine_client_nor_heavy_extras() -> None:
    assert present(loaded_after("sandbox.cli"), NOT_FOR_THE_CLI_MODULE) == []


@pytest.mark.parametrize("backend", ["sandbox.backends.docker.backend"])
def test_what_sandbox_run_imports_leaves_out_what_a_plain_run_never_uses(backend: str) -> None:
    # What `sandbox run` imports on its way to the first engine call.
    loaded = loaded_after("sandbox.cli", "sandbox.run.testrun", "sandbox.backends.choose", backend)
    assert "docker" in loaded  # the check sees real imports
    assert present(loaded, NOT_FOR_A_RUN) == []
