"""`sandbox`: the command line, a thin layer over the Python API.

Exit codes have one meaning each, the same for every command
(`sandbox.contracts.exitcodes`). `--json` on every command makes stdout JSON lines
(every line one object) and an error one object on stderr,
`{"error": {"kind": KIND, "message": TEXT}}`; without it an error is one line on stderr.
No traceback reaches the user.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from sandbox.cli.output import error
from sandbox.cli.parser import COMMANDS, build_parser, parse
from sandbox.contracts.errors import SandboxError, UsageError
from sandbox.contracts.exitcodes import ExitCode

# What only some commands need is imported by them: the command a controller calls
# (`sandbox run`) loads the run's modules and nothing else (no workflow record, no
# progress printer without --follow, no cluster client, no report renderer); this
# package itself loads no pydantic, so the start-up's collector policy
# (`sandbox.cli.startup.StartGc`) covers every model the command builds.

# The commands that run steps: a controller starts one process per run, and its
# start-up is paid by every run (see `StartGc`).
_RUNS_STEPS = frozenset({"run", "run-workflow", "verify", "verify-workflow"})


def main(argv: list[str] | None = None) -> int:
    """The command line; `argv` None: this process's own (`sys.argv`), and the process
    is this command (the console script, `python -m sandbox.cli`)."""
    return _main(argv)[0]


def _main(argv: list[str] | None) -> tuple[int, bool]:
    """`main`: the exit code, and whether this process is a command that ran steps."""
    words = sys.argv[1:] if argv is None else argv
    as_json = _json_asked(words)
    try:
        args = parse(argv, json_errors=as_json)
    except UsageError as exc:
        error(ExitCode.USAGE, str(exc), as_json=as_json)
        return ExitCode.USAGE, False
    start = None
    if argv is None and args.command in _RUNS_STEPS:
        from sandbox.cli.startup import StartGc, prefetch_engine
        from sandbox.contracts.noplugins import refuse_pydantic_plugins

        # Before pydantic loads: the runner (root) validates every record with no plugin
        # of the environment's, and never scans its distributions for one.
        refuse_pydantic_plugins()
        start = StartGc()
        prefetch_engine(args)
    args.start_gc = start
    try:
        return _dispatch(args), start is not None
    finally:
        if start is not None:
            start.end()


def _json_asked(words: Sequence[str]) -> bool:
    """`--json` among the options (before a `--` that starts another command's words)."""
    for word in words:
        if word == "--":
            return False
        if word == "--json":
            return True
    return False


def console() -> NoReturn:
    """The console script (`sandbox`) and `python -m sandbox.cli`: `main()`, then exit.

    A command that ran steps leaves without the interpreter's teardown: freeing its
    modules, the models' validators and the engine's client object by object costs a
    new process some 25 ms of CPU that a warm process (the same run through
    `execute_step`) never pays, and nothing of it is needed. Everything the run owes
    is done by then: the record is on disk (written, fsynced and renamed in place
    before `main` returns), its containers, mounts, watchers and threads are gone (the
    run's `ExitStack` and the backend's `close`). What an exit still does is done here
    in its order: the `atexit` callbacks (the logging module's flush, the finalizers
    registered for exit), then stdout and stderr flushed. Only when no thread but this
    one may still be running (a daemon thread dies at any exit) and the flush worked
    does the process end at once; otherwise it exits as usual (a stdout whose reader
    went away then says so, and exits 120, as without this)."""
    code, ran_steps = _main(None)
    if ran_steps and _alone():
        atexit._run_exitfuncs()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            sys.exit(code)
        os._exit(code)
    sys.exit(code)


def _alone() -> bool:
    """No thread but the caller's that an exit would wait for."""
    me = threading.current_thread()
    return all(thread is me or thread.daemon for thread in threading.enumerate())


def _dispatch(args: argparse.Namespace) -> int:
    as_json = bool(getattr(args, "json", False))
    try:
        code = int(args.func(args))
    except SandboxError as exc:
        error(exc.exit_code, str(exc), as_json=as_json)
        return exc.exit_code
    except KeyboardInterrupt:
        error(ExitCode.INTERRUPTED, "interrupted", as_json=as_json)
        return ExitCode.INTERRUPTED
    except Exception as exc:
        # Never a traceback: one line a user can report.
        detail = str(exc).splitlines()[0][:300] if str(exc) else ""
        message = f"{type(exc).__name__}: {detail}"
        error(ExitCode.INTERNAL, message, as_json=as_json, prefix="internal error")
        return ExitCode.INTERNAL
    if args.command in _RUNS_STEPS:
        from sandbox.cli.run import stopped

        if stopped():
            return ExitCode.INTERRUPTED  # the record (status killed) was printed
    return code


__all__ = ["COMMANDS", "build_parser", "console", "main"]
