"""The command line's parser: every command, its arguments, and its usage errors.

A usage error is argparse's (usage, then the error; exit 2) or, when `--json` was
asked, one JSON object on stderr (`sandbox.cli.output.error`). Parsing loads no
command's modules: each command imports what it needs once it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from sandbox.cli import gate as gate_cmd
from sandbox.cli import host as host_cmd
from sandbox.cli import inspect as inspect_cmd
from sandbox.cli import lock as lock_cmd
from sandbox.cli import run as run_cmd
from sandbox.cli.output import say
from sandbox.contracts.errors import UsageError
from sandbox.contracts.exitcodes import EXIT_CODES

_EPILOG = "exit codes:\n" + "\n".join(f"  {code.value:>3}  {code.kind}" for code in EXIT_CODES)


class _Parser(argparse.ArgumentParser):
    """argparse, except that with `--json` a usage error is raised (and said as JSON)."""

    def error(self, message: str) -> NoReturn:
        if _json_errors:
            raise UsageError(message)
        super().error(message)


_json_errors = False


def _json(parser: argparse.ArgumentParser, text: str) -> None:
    parser.add_argument("--json", action="store_true", help=text)


def cmd_completion(args: argparse.Namespace) -> int:
    """A completion script for `args.shell`, generated from the whole parser."""
    import shtab

    say(shtab.complete(build_parser(), shell=args.shell))
    return 0


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `run`, `run-workflow` and `verify` share (a workflow run gives them to
    every step)."""
    _json(parser, "the record (or the verdict) as one JSON line; with --follow, JSON lines")
    parser.add_argument(
        "--follow",
        action="store_true",
        help="print each guarded call and each step's start and end as it happens",
    )
    parser.add_argument("--timeout", type=float, default=None, help="override the step timeout (s)")
    parser.add_argument("--upstream-bridge", default=None, help="the real bridge to forward to")
    parser.add_argument(
        "--upstream-network", action="append", default=[], help="a Docker network the guard joins"
    )
    parser.add_argument(
        "--allow-host", action="append", default=[], help="add an egress host for this run only"
    )
    parser.add_argument(
        "--canary", default=None, help="HOST:PORT the preflight must find unreachable"
    )
    parser.add_argument(
        "--backend",
        choices=("docker", "kubernetes"),
        default=None,
        help="the engine that runs the containers (default: the host config's, else docker)",
    )
    parser.add_argument("--host-config", type=Path, default=None, help="the host's settings (TOML)")
    parser.add_argument(
        "--step-runtime",
        choices=("runc", "runsc"),
        default=None,
        help="runsc: the step under gVisor (the engine must register runsc; `sandbox doctor`)",
    )


def _replay_arguments(parser: argparse.ArgumentParser) -> None:
    """`run` and `verify`: the step's reads answered from an earlier run's recording."""
    parser.add_argument(
        "--replay",
        default=None,
        metavar="RUN",
        help="answer the step's reads from RUN's recording (a run folder or run id)",
    )
    parser.add_argument(
        "--replay-miss",
        choices=("stub", "live"),
        default="stub",
        help="a read the recording lacks: a TEST MODE replay-miss stub (default) or live",
    )


def _chain_arguments(parser: argparse.ArgumentParser) -> None:
    """A chain's range and its choice on a failed step, then the run options."""
    parser.add_argument("--from", dest="from_step", default=None, help="start at this step")
    parser.add_argument("--to", dest="to_step", default=None, help="stop after this step")
    parser.add_argument(
        "--keep-going", action="store_true", help="run the later steps after a step fails"
    )
    _run_arguments(parser)


def _verdict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--junit", default="", help="also write the verdict as JUnit XML here")
    parser.add_argument("--html", default="", help="also write the run's HTML report here")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; with `only`, only that command's own arguments are
    added (every command is still listed, with its help). Adding an argument costs
    argparse a formatter and a look at the terminal's size: the ~60 arguments of all
    the commands were some 5 to 10 ms of every start, for the one command a process runs."""
    parser = _Parser(
        prog="sandbox",
        description="Run one AI-agent workflow step (or a chain) once in test mode.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run one step once in test mode")
    if _wanted(only, "run"):
        run.add_argument("workflow_dir")
        run.add_argument("step_id")
        _run_arguments(run)
        _replay_arguments(run)
        run.set_defaults(func=run_cmd.cmd_run)

    chain = sub.add_parser("run-workflow", help="run a whole workflow's steps once in test mode")
    if _wanted(only, "run-workflow"):
        chain.add_argument("workflow_dir")
        _chain_arguments(chain)
        chain.set_defaults(func=run_cmd.cmd_run_workflow)

    ver = sub.add_parser("verify", help="run one step once and check its expectations")
    if _wanted(only, "verify"):
        ver.add_argument("workflow_dir")
        ver.add_argument("step_id")
        _run_arguments(ver)
        _replay_arguments(ver)
        _verdict_arguments(ver)
        ver.add_argument(
            "--against",
            default=None,
            metavar="last-passing|RUN",
            help="also show what changed against the last passing verification, or RUN",
        )
        ver.set_defaults(func=run_cmd.cmd_verify)

    vwf = sub.add_parser(
        "verify-workflow", help="run a whole workflow once and check its expectations file"
    )
    if _wanted(only, "verify-workflow"):
        vwf.add_argument("workflow_dir")
        vwf.add_argument("expectations", help="the workflow's expectations file (TOML)")
        _chain_arguments(vwf)
        _verdict_arguments(vwf)
        vwf.set_defaults(func=run_cmd.cmd_verify_workflow)

    gat = sub.add_parser(
        "gate", help="exit 0 when the step's (or the chain's) current version is verified"
    )
    if _wanted(only, "gate"):
        gat.add_argument("workflow_dir")
        gat.add_argument("step_id", nargs="?", default=None)
        gat.add_argument(
            "--workflow",
            default=None,
            metavar="FILE",
            help=(
                "gate the chain: a passing verify-workflow of FILE at every step's current version"
            ),
        )
        gat.add_argument(
            "--from", dest="from_step", default=None, help="with --workflow: from here"
        )
        gat.add_argument("--to", dest="to_step", default=None, help="with --workflow: to here")
        gat.add_argument(
            "--allow-no-effects",
            action="store_true",
            help="also pass a step whose test runs at this version showed no external effect",
        )
        gat.add_argument(
            "--host-config",
            type=Path,
            default=None,
            help="the host's settings (TOML) the runs used: the backend that names the images",
        )
        _json(gat, 'the answer as one JSON line: {"ok": ..., "reason": ...}')
        gat.set_defaults(func=gate_cmd.cmd_gate)

    rep = sub.add_parser("report", help="write a test run's report as one HTML file")
    if _wanted(only, "report"):
        rep.add_argument("run_dir")
        rep.add_argument("--html", default="", help="the file to write (default RUN/report.html)")
        rep.add_argument(
            "--against", default=None, metavar="RUN_B", help="add what changed against RUN_B"
        )
        _json(rep, "print the report's path as a JSON line")
        rep.set_defaults(func=inspect_cmd.cmd_report)

    show = sub.add_parser("show", help="show a test run's record")
    if _wanted(only, "show"):
        show.add_argument("run_dir")
        _json(show, "the record as one JSON line")
        show.set_defaults(func=inspect_cmd.cmd_show)

    dif = sub.add_parser(
        "diff", help="what a step (or a chain, step by step) did differently in two test runs"
    )
    if _wanted(only, "diff"):
        dif.add_argument("run_a")
        dif.add_argument("run_b")
        _json(dif, "the comparison as one JSON line")
        dif.set_defaults(func=inspect_cmd.cmd_diff)

    lst = sub.add_parser("list", help="list a workflow's runs, test runs marked")
    if _wanted(only, "list"):
        lst.add_argument("workflow_dir")
        _json(lst, "JSON lines: one object per run, then per verification")
        lst.set_defaults(func=inspect_cmd.cmd_list)

    gcp = sub.add_parser("gc", help="remove what crashed runs left behind")
    if _wanted(only, "gc"):
        gcp.add_argument("workflow_dir", nargs="*", help="also mark orphaned records here killed")
        gcp.add_argument(
            "--remove-runs",
            action="store_true",
            help="also delete the folders of these workflows' finished test runs",
        )
        gcp.add_argument(
            "--host-config", type=Path, default=None, help="the host's settings (TOML)"
        )
        _json(gcp, "what was collected as one JSON line (default: text)")
        gcp.set_defaults(func=host_cmd.cmd_gc)

    doctor = sub.add_parser("doctor", help="check this host's isolation posture")
    if _wanted(only, "doctor"):
        _json(doctor, "JSON lines: one object per check")
        doctor.set_defaults(func=host_cmd.cmd_doctor)

    img = sub.add_parser("images", help="build the images (skips what is unchanged)")
    if _wanted(only, "images"):
        img.add_argument("action", choices=["build"])
        img.add_argument("--base-image", default="", help="a registry base instead of mmdebstrap")
        _json(img, "the images as one JSON line (default: text)")
        img.set_defaults(func=host_cmd.cmd_images)

    bench = (
        sub.add_parser("bench", help="run the benchmarks; table + bench/results.json")
        if host_cmd.bench_checkout() is not None
        else None
    )
    if bench is not None and _wanted(only, "bench"):
        bench.add_argument("--only", default="", help="comma-separated subset, e.g. startup,guard")
        bench.add_argument(
            "--quick", action="store_true", help="small sizes (developing the bench)"
        )
        bench.add_argument("--out", default="", help="results JSON (default bench/results.json)")
        bench.add_argument(
            "--markdown", action="store_true", help="print the saved table as markdown"
        )
        bench.add_argument(
            "--load", action="store_true", help="the same figures beside a CPU and disk hog"
        )
        _json(bench, "the saved results as one JSON line; the table goes to stderr")
        bench.set_defaults(func=host_cmd.cmd_bench)

    lck = sub.add_parser(
        "lock", help="run a command holding the workflow's run lock (keeps test runs out)"
    )
    if _wanted(only, "lock"):
        lck.add_argument("workflow_dir")
        mode = lck.add_mutually_exclusive_group(required=True)
        mode.add_argument(
            "--shared",
            action="store_true",
            help="a normal run: shares with other normal runs, keeps test runs out",
        )
        mode.add_argument(
            "--exclusive", action="store_true", help="hold the workflow alone (no run may start)"
        )
        lck.add_argument("--owner", default="", help="who holds it, as a refused run names it")
        lck.add_argument(
            "--host-config",
            type=Path,
            default=None,
            help="the host's settings (TOML); on a fleet the lock is also the cluster's",
        )
        _json(lck, "an error as one JSON object on stderr (stdout is the command's)")
        lck.add_argument("cmd", nargs="*", metavar="-- CMD [ARG ...]")
        lck.set_defaults(func=lock_cmd.cmd_lock)

    comp = sub.add_parser("completion", help="print a shell completion script")
    if _wanted(only, "completion"):
        comp.add_argument("shell", choices=("bash", "zsh", "tcsh"))
        comp.set_defaults(func=cmd_completion)
    return parser


class _VersionAction(argparse.Action):
    """`--version`: prints `sandbox <version>` and exits 0. The version is read when the
    option is given, not at every start (reading the distribution's metadata costs)."""

    def __init__(self, option_strings: list[str], dest: str, **_: object) -> None:
        super().__init__(
            option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS,
            help="print the version and exit",
        )  # fmt: skip

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from sandbox.contracts.version import runner_version

        sys.stdout.write(f"sandbox {runner_version()}\n")
        parser.exit()


def _wanted(only: str | None, command: str) -> bool:
    return only is None or only == command


COMMANDS = frozenset(
    {
        "run",
        "run-workflow",
        "verify",
        "verify-workflow",
        "gate",
        "report",
        "show",
        "diff",
        "list",
        "gc",
        "doctor",
        "images",
        "bench",
        "lock",
        "completion",
    }
)


def command_named(argv: list[str]) -> str | None:
    """The command `argv` names, known before parsing: its first word that is not an
    option (the top level has none but --help and --version). None, and every command is built, when
    that word is no command: argparse's error (or help) is then the one it always gave."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def parse(argv: list[str] | None, *, json_errors: bool) -> argparse.Namespace:
    """The parsed command line (`argv` None: this process's); `lock`'s command is every
    word after the first `--`, whatever it looks like."""
    global _json_errors
    words = sys.argv[1:] if argv is None else list(argv)
    tail: list[str] | None = None
    if command_named(words) == "lock" and "--" in words:
        at = words.index("--")
        words, tail = words[:at], words[at + 1 :]
    if command_named(words) == "bench" and host_cmd.bench_checkout() is None:
        raise UsageError(host_cmd.BENCH_ELSEWHERE)
    _json_errors = json_errors
    try:
        args = build_parser(command_named(words)).parse_args(words)
    finally:
        _json_errors = False
    if tail is not None:
        if args.cmd:
            raise UsageError("give the command once, after --")
        args.cmd = tail
    return args
