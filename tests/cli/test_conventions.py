"""The CLI's conventions that need no engine: one exit-code table that the README shows,
`--json` on every command, usage errors as JSON when asked, a completion script built
from the parser, and `sandbox lock` running a command with the workflow's lock."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.cli.parser import COMMANDS, build_parser
from sandbox.contracts.errors import (
    ConfigError,
    EngineError,
    LaunchError,
    PrepareError,
    RefusedError,
    UsageError,
)
from sandbox.contracts.exitcodes import EXIT_CODES, ExitCode, markdown_table
from sandbox.prepare.lock import LockHeldError, workflow_run_lock
from tests import paths

EXIT_CODES_PAGE = paths.REPO / "docs" / "reference" / "exit-codes.md"


def sandbox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_each_exit_code_has_one_meaning_and_the_docs_show_the_table() -> None:
    assert set(EXIT_CODES) == set(ExitCode)
    assert len({c.value for c in ExitCode}) == len(ExitCode)
    assert ExitCode.INTERRUPTED.value == 130
    assert markdown_table() in EXIT_CODES_PAGE.read_text()


def test_each_error_kind_exits_with_its_own_code() -> None:
    codes = {
        cls: cls.exit_code
        for cls in (UsageError, ConfigError, RefusedError, EngineError, PrepareError, LaunchError)
    }
    assert codes == {
        UsageError: ExitCode.USAGE,
        ConfigError: ExitCode.CONFIG,
        RefusedError: ExitCode.REFUSED,
        EngineError: ExitCode.ENVIRONMENT,
        PrepareError: ExitCode.ENVIRONMENT,
        LaunchError: ExitCode.ENVIRONMENT,
    }


def test_every_command_but_completion_takes_json() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in sorted(COMMANDS - {"completion"}):
        options = {o for a in sub.choices[name]._actions for o in a.option_strings}
        assert "--json" in options, name


@pytest.mark.parametrize(
    "argv",
    [["run", "--json"], ["nope", "--json"], ["gc", "--bogus", "--json"], ["lock", "x", "--json"]],
)
def test_a_usage_error_in_json_mode_is_one_object_on_stderr(argv: list[str]) -> None:
    done = sandbox(*argv)
    assert done.returncode == ExitCode.USAGE and done.stdout == ""
    (line,) = done.stderr.splitlines()
    error = json.loads(line)["error"]
    assert error["kind"] == "usage" and error["message"]


def test_a_usage_error_without_json_is_argparses_usage_and_exit_2() -> None:
    done = sandbox("run")
    assert done.returncode == ExitCode.USAGE
    assert done.stderr.startswith("usage: sandbox run")


def test_the_bash_completion_script_is_valid_bash_and_knows_every_command() -> None:
    done = sandbox("completion", "bash")
    assert done.returncode == 0, done.stderr
    for name in COMMANDS:
        assert name in done.stdout
    assert "--allow-no-effects" in done.stdout  # a subcommand's own option
    bash = shutil.which("bash")
    assert bash is not None
    check = subprocess.run([bash, "-n"], input=done.stdout, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_sandbox_lock_holds_the_shared_lock_while_cmd_runs_and_passes_its_code_on(
    tmp_path: Path,
) -> None:
    wf = tmp_path / "wf"
    wf.mkdir()
    # CMD tries to take the exclusive lock (as a test run does): it must be refused.
    probe = (
        "import sys\n"
        "from sandbox.prepare.lock import LockHeldError, workflow_run_lock\n"
        "try:\n"
        f"    workflow_run_lock({str(wf)!r}, exclusive=True)\n"
        "except LockHeldError as exc:\n"
        "    sys.exit(9 if 'controller run 17' in str(exc) else 8)\n"
        "sys.exit(0)\n"
    )
    held = sandbox(
        "lock",
        "--shared",
        str(wf),
        "--owner",
        "controller run 17",
        "--",
        sys.executable,
        "-c",
        probe,
    )
    assert held.returncode == 9, held.stderr
    # Released once CMD ended: a test run's lock is free again.
    with workflow_run_lock(wf, exclusive=True):
        refused = sandbox("lock", "--shared", str(wf), "--json", "--", "true")
        assert refused.returncode == ExitCode.REFUSED
        assert json.loads(refused.stderr)["error"]["kind"] == "refused"
        with pytest.raises(LockHeldError):
            workflow_run_lock(wf)
    assert sandbox("lock", "--shared", str(wf), "--", str(tmp_path / "missing")).returncode == 127
