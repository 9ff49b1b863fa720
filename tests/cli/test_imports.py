"""The command a controller calls stays cheap to start: `sandbox run` loads the run's
modules and nothing a run does not need.

Checked in a fresh interpreter through `sys.modules` (what was imported), never by
timing: each module named here costs every CLI call its import, and none of them is
needed before (or during) a test run that has no TLS inspection and no DB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandbox.cli.parser import COMMANDS, build_parser

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
    "sandbox.guard.egress.tls",
    "sandbox.policy",  # the guard judges calls; the runner only hashes the files
    "sandbox.policy_sql",
    "sandbox.stepside.agentworks_exec.server",
    "sandbox.stepside.agentworks_exec.supervisor",
    # Its find_library runs `ldconfig -p` as a new process (the mounts use the
    # interpreter's own C library instead).
    "ctypes.util",
    # The runner's own start time is read from /proc (`sandbox.hostfs.procstart`); psutil
    # names the holders of a lock only when it is refused.
    "psutil",
    "sqlite3",  # only a run with a DB copies it
    # The guard's event loop: the runner sizes the guard's container from
    # `sandbox.contracts.guardprocess`, never from the guard's asyncio code.
    "asyncio",
)

# Not needed to parse the command line (nor by `sandbox show`/`list`): the engine's SDK;
# nor pydantic: the models are built once the command runs, inside the start-up's
# collector policy (`sandbox.cli.startup.StartGc`).
NOT_FOR_THE_CLI_MODULE = (
    *NOT_FOR_A_RUN,
    "docker",
    "requests",
    "pydantic",
    "sandbox.contracts.record",
    "sandbox.run.testrun",
)


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


def test_the_engine_prefetch_loads_no_engine_client_nor_pydantic() -> None:
    # `sandbox run` asks the engine for its version before its heavy imports.
    loaded = loaded_after(
        "sandbox.cli", "sandbox.backends.docker.prefetch", "sandbox.contracts.hostpath"
    )
    assert present(loaded, NOT_FOR_THE_CLI_MODULE) == []


@pytest.mark.parametrize("backend", ["sandbox.backends.docker.backend"])
def test_what_sandbox_run_imports_leaves_out_what_a_plain_run_never_uses(backend: str) -> None:
    # What `sandbox run` imports on its way to the first engine call.
    loaded = loaded_after("sandbox.cli", "sandbox.run.testrun", "sandbox.backends.choose", backend)
    assert "docker" in loaded  # the check sees real imports
    assert present(loaded, NOT_FOR_A_RUN) == []


# Read only once the step ran (the action log's summary and its stub groups, with the
# chain record's types they share, and the action lines' models they read):
# `sandbox.collect.harvest.warm_up` imports them while the launch waits on the engine,
# so they are not CPU before the run's first container.
ONLY_FOR_THE_COLLECT = (
    "sandbox.collect.actionsummary",
    "sandbox.collect.stubgroups",
    "sandbox.contracts.workflow_record",
    "sandbox.contracts.wire",
)


def test_what_sandbox_run_imports_before_its_first_container_leaves_out_the_collects() -> None:
    loaded = loaded_after(
        "sandbox.cli", "sandbox.cli.run", "sandbox.run.testrun", "sandbox.backends.docker.backend"
    )
    assert "sandbox.collect.harvest" in loaded  # the check sees real imports
    assert present(loaded, ONLY_FOR_THE_COLLECT) == []
    # ...and the launch's warm-up loads them (in its thread; joined here).
    code = textwrap.dedent(
        """
        import json, sys, threading
        from sandbox.collect import harvest
        harvest.warm_up()
        for thread in threading.enumerate():
            if thread.name == "collect-imports":
                thread.join(60)
        print(json.dumps(sorted(sys.modules)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert present(set(json.loads(done.stdout)), ONLY_FOR_THE_COLLECT) == list(ONLY_FOR_THE_COLLECT)


def after_main(argv: list[str] | None, sys_argv: list[str]) -> dict[str, object]:
    """In a new interpreter: `main(argv)` with `sys.argv` set; then the collector's state,
    and whether the engine's client class and the run's record were frozen."""
    code = textwrap.dedent(
        f"""
        import contextlib, gc, io, json, sys
        sys.argv = {sys_argv!r}
        from sandbox.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            exit_code = main({argv!r})
        tracked = {{id(o) for o in gc.get_objects()}}  # the permanent generation is not listed
        client = sys.modules.get("docker.api.client")
        print(json.dumps({{
            "exit_code": exit_code,
            "enabled": gc.isenabled(),
            "frozen": gc.get_freeze_count(),
            "client_frozen": None if client is None else id(client.APIClient) not in tracked,
        }}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_main_with_an_argv_leaves_the_callers_collector_alone(tmp_path: Path) -> None:
    state = after_main(["run", f"{tmp_path}/missing", "step1"], ["pytest"])
    assert state["exit_code"] == 4  # a configuration error
    assert state["enabled"] is True and state["frozen"] == 0


def test_a_run_that_fails_before_the_engine_still_ends_with_the_collector_on(
    tmp_path: Path,
) -> None:
    state = after_main(None, ["sandbox", "run", f"{tmp_path}/missing", "step1"])
    assert state["exit_code"] == 4  # a configuration error
    assert state["enabled"] is True
    assert isinstance(state["frozen"], int) and state["frozen"] > 10_000


def console_exit(tmp_path: Path, before: str) -> subprocess.CompletedProcess[str]:
    """In a new interpreter with a buffered stdout: `before`, then `console()` on a run
    that fails before the engine (exit 4, a configuration error)."""
    code = textwrap.dedent(
        f"""
        import atexit, sys, threading
        sys.argv = ["sandbox", "run", {str(tmp_path / "missing")!r}, "step1"]
        {before}
        from sandbox.cli import console
        console()
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def test_the_console_exit_keeps_the_code_the_exit_callbacks_and_the_buffered_output(
    tmp_path: Path,
) -> None:
    done = console_exit(tmp_path, "atexit.register(print, 'at exit'); print('buffered')")
    assert done.returncode == 4  # a configuration error
    assert done.stdout.splitlines() == ["buffered", "at exit"]
    assert done.stderr.startswith("sandbox: error: workflow folder not found")


def test_the_console_exit_waits_for_a_thread_that_is_still_running(tmp_path: Path) -> None:
    # A non-daemon thread that goes on once the main thread has ended: the process
    # exits as usual and lets it finish (its line is printed), never cut short.
    later = (
        "threading.Thread(target=lambda: (threading.main_thread().join(), print('thread done')))"
        ".start()"
    )
    done = console_exit(tmp_path, later)
    assert done.returncode == 4  # a configuration error
    assert done.stdout.splitlines() == ["thread done"]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_a_parser_built_for_one_command_parses_and_helps_as_the_whole_one() -> None:
    whole = _subcommands(build_parser())
    assert set(whole) == COMMANDS
    for name in sorted(COMMANDS):
        only = build_parser(name)
        assert only.format_help() == build_parser().format_help()
        assert _subcommands(only)[name].format_help() == whole[name].format_help(), name


# Models a single step's run imports (a module it needs holds them) but never validates:
# built on first use (`defer_build`), so their schema build is not CPU that every
# `sandbox run` pays before its first container.
NOT_BUILT_FOR_A_RUN = (
    "sandbox.contracts.workflow_record:WorkflowRunRecord",
    "sandbox.contracts.workflow_record:ChainStep",
    "sandbox.contracts.workflow_record:ChainTotals",
    "sandbox.contracts.workflow_record:ChainStubbedAction",
)


def test_what_sandbox_run_imports_builds_no_model_a_single_step_never_validates() -> None:
    code = textwrap.dedent(
        f"""
        import importlib, json
        for name in ["sandbox.cli", "sandbox.run.testrun", "sandbox.backends.docker.backend"]:
            importlib.import_module(name)
        built = []
        for spec in {list(NOT_BUILT_FOR_A_RUN)!r}:
            module, _, name = spec.partition(":")
            if getattr(importlib.import_module(module), name).__pydantic_complete__:
                built.append(spec)
        print(json.dumps(built))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(done.stdout) == []
    # ...and each still builds, and validates, when it is used.
    from sandbox.contracts.workflow_record import ChainTotals

    assert ChainTotals.model_validate({"steps": 2}).steps == 2
