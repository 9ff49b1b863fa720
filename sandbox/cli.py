"""`sandbox`: the command line, a thin layer over the Python API.

Exit codes: 0 the step (or every step of a workflow run) passed, 1 it failed or
timed out (or was killed), 2 usage, configuration or environment error, 3 refused.
`verify`, `verify-workflow` and `gate`: 0 verified / the gate holds, 1 not, 2
usage error (an expectation that does not parse included). Errors are one line
on stderr; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from sandbox.contracts.errors import ConfigError, SandboxError
from sandbox.contracts.status import RECORD_FILE, REPORT_FILE, RunStatus
from sandbox.termsafe import clean

# What only some commands need is imported by them: the command a controller calls
# (`sandbox run`) loads the run's modules and nothing else (no workflow record, no
# progress printer without --follow, no cluster client, no report renderer); this
# module itself loads no pydantic, so the start-up's collector policy (`_StartGc`)
# covers every model the command builds.
if TYPE_CHECKING:
    from sandbox.backends import Backend, BackendFactory
    from sandbox.contracts.workflow_record import AnyRecord
    from sandbox.progress import FollowPrinter
    from sandbox.run.testrun import RunOptions
    from sandbox.verify.against import VerifiedAgainst
    from sandbox.verify.verification import Verification
    from sandbox.verify.workflow_verification import WorkflowVerification


def say(text: str = "", *, err: bool = False) -> None:
    """Every line the CLI prints goes through here: control characters escaped."""
    print(clean(text), file=sys.stderr if err else sys.stdout)


EXIT_BY_STATUS = {
    RunStatus.PASSED: 0,
    RunStatus.FAILED: 1,
    RunStatus.TIMEOUT: 1,
    RunStatus.KILLED: 1,
    RunStatus.QUOTA: 1,
    RunStatus.ERROR: 2,
    RunStatus.REFUSED: 3,
    RunStatus.RUNNING: 1,
}


def _print_record(record: AnyRecord, as_json: bool, *, one_line: bool = False) -> None:
    if as_json:
        # JSON escapes every control character itself (ensure_ascii-free text is safe).
        say(record.model_dump_json(indent=None if one_line else 2))
        return
    from sandbox.contracts.record import TestRunRecord

    if not isinstance(record, TestRunRecord):  # a workflow run's record (AnyRecord)
        for line in record.summary_lines():
            say(clean(line, keep_newlines=False))
        say(f"record: {Path(record.workflow_dir) / 'runs' / record.id / 'test_mode.json'}")
        return
    from sandbox.verify.effects import effect_lines

    for line in record.summary_lines() + effect_lines(record):
        say(clean(line, keep_newlines=False))
    run_root = Path(record.workflow_dir) / "runs" / record.id
    say(f"record: {run_root / 'test_mode.json'}")
    if record.stdout.text:
        say("--- stdout (tail) ---")
        say(record.stdout.text.rstrip())
    if record.stderr.text:
        say("--- stderr (tail) ---")
        say(record.stderr.text.rstrip())


def _stop_on_signals() -> None:
    """SIGTERM ends the run as `killed` (RunInterrupted), SIGINT as Python's ^C does; both
    held back where a container is being created or counted (`sandbox.stopsignals`)."""
    from sandbox import stopsignals
    from sandbox.run.testrun import RunInterrupted

    stopsignals.on_stop(signal.SIGTERM, RunInterrupted)
    stopsignals.on_stop(signal.SIGINT, KeyboardInterrupt)


def _run_options(args: argparse.Namespace, printer: FollowPrinter | None) -> RunOptions:
    from sandbox.run.testrun import RunOptions

    durability = None  # the run reads the host's config itself
    if getattr(args, "host_config", None) is not None:
        from sandbox.contracts.hostconfig import load_host_config

        durability = load_host_config(args.host_config).durability
    return RunOptions(
        durability=durability,
        timeout_s=args.timeout,
        upstream_bridge=args.upstream_bridge,
        upstream_networks=tuple(args.upstream_network),
        allow_hosts=tuple(args.allow_host),
        canary=args.canary,
        step_runtime=args.step_runtime,
        on_event=printer,
    )


class _StartGc:
    """The collector while a process that runs steps starts: off while the command's
    modules load, frozen and back on once the first backend is connected.

    Start-up makes some 70,000 objects (modules, classes, the pydantic models' validators,
    the engine's client) that live until the process exits: a collection pass over them
    finds nothing, yet the allocations of the imports trigger one pass after another,
    and the interpreter's exit scans them all once more. `gc.freeze()` moves them to a
    generation the collector never visits, so the run's own collections (the collector
    is on again for everything the run allocates) and the exit's skip them. The price:
    the few cycles already garbage when frozen (about 1,600 objects) are kept until exit.
    Only for a process that is this command (`main()` reading `sys.argv`): a caller of
    `main([...])` keeps its own collector as it was."""

    def __init__(self) -> None:
        self._was_enabled = gc.isenabled()
        self._ended = False
        gc.disable()

    def end(self) -> None:
        """Freeze what start-up made and restore the collector; later calls do nothing."""
        if self._ended:
            return
        self._ended = True
        gc.freeze()
        if self._was_enabled:
            gc.enable()

    def after_connect(self, factory: BackendFactory) -> BackendFactory:
        """`factory`, ending start-up once it returns: the engine's client is its last
        import, and the run's work (copying, collecting) begins after it."""

        def connect() -> Backend:
            backend = factory()
            self.end()
            return backend

        return connect


def _backend(args: argparse.Namespace) -> BackendFactory | None:
    """The backend `--backend`/`--host-config` name; None leaves it to the host's config
    (the run's default factory), unless start-up waits for the connection."""
    start: _StartGc | None = getattr(args, "start_gc", None)
    if args.backend is None and args.host_config is None:
        if start is None:
            return None
        from sandbox.run.testrun import host_backend

        return start.after_connect(host_backend)
    from sandbox.backends.choose import connect_backend
    from sandbox.contracts.hostconfig import load_host_config

    config = load_host_config(args.host_config).backend
    if args.backend is not None:
        config = config.model_copy(update={"kind": args.backend})
    factory: BackendFactory = lambda: connect_backend(config)  # noqa: E731
    return factory if start is None else start.after_connect(factory)


@contextlib.contextmanager
def _follow(args: argparse.Namespace) -> Iterator[FollowPrinter | None]:
    """`--follow`: the printer the run reports to, closed before the record prints."""
    if not args.follow:
        yield None
        return
    from sandbox.progress import FollowPrinter

    printer = FollowPrinter.for_stream(sys.stdout, as_json=args.json)
    try:
        yield printer
    finally:
        printer.close()


def cmd_run(args: argparse.Namespace) -> int:
    from sandbox.run.testrun import TestRun

    _stop_on_signals()
    with _follow(args) as printer:
        options = _run_options(args, printer)
        record = TestRun(
            Path(args.workflow_dir), args.step_id, options, backend=_backend(args)
        ).execute()
    _print_record(record, args.json, one_line=args.follow)
    return EXIT_BY_STATUS[record.status]


def cmd_run_workflow(args: argparse.Namespace) -> int:
    from sandbox.run.workflowrun import WorkflowOptions, WorkflowRun

    _stop_on_signals()
    with _follow(args) as printer:
        options = WorkflowOptions(
            from_step=args.from_step,
            to_step=args.to_step,
            keep_going=args.keep_going,
            step=_run_options(args, printer),
        )
        record = WorkflowRun(Path(args.workflow_dir), options, backend=_backend(args)).execute()
    _print_record(record, args.json, one_line=args.follow)
    return EXIT_BY_STATUS[record.status]


def cmd_verify(args: argparse.Namespace) -> int:
    from sandbox.verify.junit import write_junit
    from sandbox.verify.verifystep import verify_step

    if args.against:
        from sandbox.verify.against import check_named, verify_against

        check_named(Path(args.workflow_dir), args.against)
    _stop_on_signals()
    with _follow(args) as printer:
        verification = verify_step(
            Path(args.workflow_dir),
            args.step_id,
            _run_options(args, printer),
            backend=_backend(args),
        )
    if args.junit:
        write_junit(Path(args.junit), verification)
    if args.against:
        return _report_verification(
            args, verify_against(Path(args.workflow_dir), verification, args.against)
        )
    return _report_verification(args, verification)


def cmd_verify_workflow(args: argparse.Namespace) -> int:
    from sandbox.run.workflowrun import WorkflowOptions
    from sandbox.verify.junit import write_workflow_junit
    from sandbox.verify.verifyworkflow import verify_workflow

    _stop_on_signals()
    with _follow(args) as printer:
        options = WorkflowOptions(
            from_step=args.from_step,
            to_step=args.to_step,
            keep_going=args.keep_going,
            step=_run_options(args, printer),
        )
        verification = verify_workflow(
            Path(args.workflow_dir), args.expectations, options, backend=_backend(args)
        )
    if args.junit:
        write_workflow_junit(Path(args.junit), verification)
    return _report_verification(args, verification)


def _report_verification(
    args: argparse.Namespace, verification: Verification | WorkflowVerification | VerifiedAgainst
) -> int:
    """What `verify` and `verify-workflow` both do with a verdict: the HTML report, the
    verdict printed (JSON or terminal-safe lines), and the exit code (0 only if it held)."""
    if args.html:
        from sandbox.verify.finished import load_run
        from sandbox.verify.html import write_report

        run_root = Path(args.workflow_dir) / "runs" / verification.run_id
        against = getattr(verification, "comparison", None)
        write_report(load_run(run_root), Path(args.html), against)
    if args.json:
        say(verification.model_dump_json(indent=2))
    else:
        for line in verification.lines():
            say(clean(line, keep_newlines=False))
    return 0 if verification.passed else 1


def cmd_gate(args: argparse.Namespace) -> int:
    from sandbox.verify.gate import gate, gate_workflow

    if args.workflow is not None:
        if args.step_id is not None or args.allow_no_effects:
            raise ConfigError("--workflow gates a chain: give no step and no --allow-no-effects")
        result = gate_workflow(
            Path(args.workflow_dir),
            args.workflow,
            from_step=args.from_step,
            to_step=args.to_step,
        )
    elif args.step_id is None:
        raise ConfigError("give a step to gate, or --workflow FILE to gate the chain")
    elif args.from_step is not None or args.to_step is not None:
        raise ConfigError("--from and --to go with --workflow")
    else:
        result = gate(Path(args.workflow_dir), args.step_id, allow_no_effects=args.allow_no_effects)
    say(
        ("gate: ok: " if result.ok else "gate: blocked: ")
        + clean(result.reason, keep_newlines=False)
    )
    return 0 if result.ok else 1


def cmd_report(args: argparse.Namespace) -> int:
    from sandbox.verify.finished import load_run
    from sandbox.verify.html import write_report
    from sandbox.verify.seal import unsealed

    run_dir = Path(args.run_dir)
    if not (run_dir / RECORD_FILE).is_file():
        raise ConfigError(f"no test_mode.json in {run_dir}")
    try:
        run = load_run(run_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{run_dir}/test_mode.json unreadable: {str(exc).splitlines()[0]}"
        ) from None
    if why := unsealed(run.record):
        raise ConfigError(f"{run_dir}: {why}; no report written")
    out = Path(args.html) if args.html else run_dir / REPORT_FILE
    if args.against:
        from sandbox.verify.compare import compare

        write_report(run, out, compare(Path(args.against), run))
    else:
        write_report(run, out)
    say(f"report: {out}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from sandbox.verify.finished import load_run

    run_dir = Path(args.run_dir)
    try:
        record = load_run(run_dir).record
    except FileNotFoundError:
        raise ConfigError(f"no test_mode.json in {run_dir}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{run_dir}/test_mode.json unreadable: {str(exc).splitlines()[0]}"
        ) from None
    _print_record(record, args.json)
    from sandbox.verify.seal import unsealed

    if why := unsealed(record):
        say(f"warning: {why}", err=True)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """0: no difference, 1: the runs differ (as diff(1)), 2: a run cannot be compared."""
    from sandbox.verify.compare import compare

    result = compare(Path(args.run_a), Path(args.run_b))
    for line in [result.model_dump_json(indent=2)] if args.json else result.lines():
        say(line)
    return 0 if result.same else 1


def _listed_status(record: AnyRecord) -> str:
    """`running` only while its runner lives; else what `sandbox gc` will record."""
    from sandbox.backends.docker.gc import record_runner_alive

    if record.status is RunStatus.RUNNING and not record_runner_alive(record.runner):
        return "killed (its runner is gone; `sandbox gc` records it)"
    return record.status.value


def cmd_list(args: argparse.Namespace) -> int:
    from sandbox.contracts.layout import TEST_RUN_PREFIX, is_test_run
    from sandbox.contracts.workflow_record import WorkflowRunRecord, read_any_record

    runs = Path(args.workflow_dir) / "runs"
    if not runs.is_dir():
        raise ConfigError(f"no runs folder in {args.workflow_dir}")
    for path in sorted(p for p in runs.iterdir() if p.is_dir() and not p.is_symlink()):
        if path.name.startswith(TEST_RUN_PREFIX) and not is_test_run(path.name):
            continue  # the verification history's folder, listed below
        if is_test_run(path.name):
            try:
                record = read_any_record(path)
                if isinstance(record, WorkflowRunRecord):
                    chain = " -> ".join(s.step_id for s in record.steps)
                    say(f"{path.name}  [workflow test run]  {chain}  {_listed_status(record)}")
                else:
                    say(f"{path.name}  [test run]  {record.step_id}  {_listed_status(record)}")
            except (OSError, ValueError):
                say(f"{path.name}  [test run]  (no readable record)")
        else:
            say(f"{path.name}  [real run]")
    from sandbox.verify import history

    entries = history.read(Path(args.workflow_dir))
    if entries:
        say("verifications (oldest first):")
    for entry in entries:
        verdict = "pass" if entry.passed else "FAIL: " + "; ".join(entry.failed[:3])
        digest = entry.content.digest[:12] if entry.content else "?"
        say(
            f"  {entry.at:%Y-%m-%d %H:%M:%S}  {entry.step_id}  {verdict}  "
            f"hash {digest}  {entry.run_id}"
        )
    chains = history.read_workflow(Path(args.workflow_dir))
    if chains:
        say("workflow verifications (oldest first):")
    for verified in chains:
        verdict = "pass" if verified.passed else "FAIL: " + "; ".join(verified.failed[:3])
        say(
            f"  {verified.at:%Y-%m-%d %H:%M:%S}  {' -> '.join(verified.chain_steps)}  "
            f"{verified.expectations_file}  {verdict}  {verified.run_id}"
        )
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from sandbox.backends.docker import gc
    from sandbox.contracts.hostconfig import load_host_config

    dirs = [Path(p) for p in args.workflow_dir]
    backend = load_host_config(args.host_config).backend
    if backend.kind == "kubernetes":
        from sandbox.backends.choose import collect_cluster

        report = gc.GcReport()
        roots = collect_cluster(backend, report)
        report = gc.collect_host(report, roots, dirs, remove_runs=args.remove_runs)
    else:
        from sandbox.backends.docker.client import connect

        with contextlib.closing(connect()) as client:
            report = gc.collect(client, dirs, remove_runs=args.remove_runs)
    say(report.model_dump_json(indent=2))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from sandbox.doctor import run_checks

    checks = run_checks()
    for check in checks:
        mark = "FAIL" if not check.ok else ("warn" if check.warn else "ok  ")
        say(f"[{mark}] {check.name}: {check.detail}")
        if not check.ok and check.fix:
            say(f"       fix: {check.fix}")
    return 0 if all(c.ok for c in checks) else 2


def cmd_images(args: argparse.Namespace) -> int:
    from sandbox.backends.docker.client import connect
    from sandbox.backends.docker.images import build_all

    with contextlib.closing(connect()) as client:
        built = build_all(client, base_image=args.base_image or None)
    say(built.model_dump_json(indent=2))
    return 0


# `sandbox bench` is a development command: the benchmarks are not part of the installed
# package (they need the checkout's fake upstreams and write its `bench/results.json`), so
# an installed wheel neither offers it nor runs it.
BENCH_ELSEWHERE = (
    "`sandbox bench` runs from a source checkout (the benchmarks are not installed "
    "with the package): run `make bench` in a clone of the repository"
)


def _bench_checkout() -> Path | None:
    """The source checkout this package runs from, when it holds the benchmarks."""
    checkout = Path(__file__).resolve().parents[1]
    return checkout if (checkout / "bench" / "__init__.py").is_file() else None


def _bench_main() -> Callable[[list[str]], int]:
    """The benchmarks' entry point, from the source checkout this package runs from."""
    checkout = _bench_checkout()
    if checkout is None:
        raise ConfigError(BENCH_ELSEWHERE)
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    from bench.harness import main

    return main


def cmd_bench(args: argparse.Namespace) -> int:
    bench_main = _bench_main()

    argv = ["--only", args.only] if args.only else []
    argv += ["--out", args.out] if args.out else []
    argv += ["--quick"] if args.quick else []
    argv += ["--markdown"] if args.markdown else []
    argv += ["--load"] if args.load else []
    return bench_main(argv)


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `run`, `run-workflow` and `verify` share (a workflow run gives them to
    every step)."""
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
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


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; with `only`, only that command's own arguments are
    added (every command is still listed, with its help). Adding an argument costs
    argparse a formatter and a look at the terminal's size: the ~60 arguments of all
    the commands were some 5 to 10 ms of every start, for the one command a process runs."""
    parser = argparse.ArgumentParser(prog="sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one step once in test mode")
    if _wanted(only, "run"):
        run.add_argument("workflow_dir")
        run.add_argument("step_id")
        _run_arguments(run)
        run.set_defaults(func=cmd_run)

    chain = sub.add_parser("run-workflow", help="run a whole workflow's steps once in test mode")
    if _wanted(only, "run-workflow"):
        chain.add_argument("workflow_dir")
        chain.add_argument("--from", dest="from_step", default=None, help="start at this step")
        chain.add_argument("--to", dest="to_step", default=None, help="stop after this step")
        chain.add_argument(
            "--keep-going", action="store_true", help="run the later steps after a step fails"
        )
        _run_arguments(chain)
        chain.set_defaults(func=cmd_run_workflow)

    ver = sub.add_parser("verify", help="run one step once and check its expectations")
    if _wanted(only, "verify"):
        ver.add_argument("workflow_dir")
        ver.add_argument("step_id")
        _run_arguments(ver)
        ver.add_argument("--junit", default="", help="also write the verdict as JUnit XML here")
        ver.add_argument("--html", default="", help="also write the run's HTML report here")
        ver.add_argument(
            "--against",
            default=None,
            metavar="last-passing|RUN",
            help="also show what changed against the last passing verification, or RUN",
        )
        ver.set_defaults(func=cmd_verify)

    vwf = sub.add_parser(
        "verify-workflow", help="run a whole workflow once and check its expectations file"
    )
    if _wanted(only, "verify-workflow"):
        vwf.add_argument("workflow_dir")
        vwf.add_argument("expectations", help="the workflow's expectations file (TOML)")
        vwf.add_argument("--from", dest="from_step", default=None, help="start at this step")
        vwf.add_argument("--to", dest="to_step", default=None, help="stop after this step")
        vwf.add_argument(
            "--keep-going", action="store_true", help="run the later steps after a step fails"
        )
        _run_arguments(vwf)
        vwf.add_argument("--junit", default="", help="also write the verdict as JUnit XML here")
        vwf.add_argument("--html", default="", help="also write the run's HTML report here")
        vwf.set_defaults(func=cmd_verify_workflow)

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
        gat.set_defaults(func=cmd_gate)

    rep = sub.add_parser("report", help="write a test run's report as one HTML file")
    if _wanted(only, "report"):
        rep.add_argument("run_dir")
        rep.add_argument("--html", default="", help="the file to write (default RUN/report.html)")
        rep.add_argument(
            "--against", default=None, metavar="RUN_B", help="add what changed against RUN_B"
        )
        rep.set_defaults(func=cmd_report)

    show = sub.add_parser("show", help="show a test run's record")
    if _wanted(only, "show"):
        show.add_argument("run_dir")
        show.add_argument("--json", action="store_true")
        show.set_defaults(func=cmd_show)

    dif = sub.add_parser(
        "diff", help="what a step (or a chain, step by step) did differently in two test runs"
    )
    if _wanted(only, "diff"):
        dif.add_argument("run_a")
        dif.add_argument("run_b")
        dif.add_argument("--json", action="store_true")
        dif.set_defaults(func=cmd_diff)

    lst = sub.add_parser("list", help="list a workflow's runs, test runs marked")
    if _wanted(only, "list"):
        lst.add_argument("workflow_dir")
        lst.set_defaults(func=cmd_list)

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
        gcp.set_defaults(func=cmd_gc)

    doctor = sub.add_parser("doctor", help="check this host's isolation posture")
    if _wanted(only, "doctor"):
        doctor.set_defaults(func=cmd_doctor)

    img = sub.add_parser("images", help="build the images (skips what is unchanged)")
    if _wanted(only, "images"):
        img.add_argument("action", choices=["build"])
        img.add_argument("--base-image", default="", help="a registry base instead of mmdebstrap")
        img.set_defaults(func=cmd_images)

    if _bench_checkout() is None:
        return parser
    bench = sub.add_parser("bench", help="run the benchmarks; table + bench/results.json")
    if _wanted(only, "bench"):
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
        bench.set_defaults(func=cmd_bench)
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


def _command_named(argv: list[str]) -> str | None:
    """The command `argv` names, known before parsing: its first word that is not an
    option (the top level has none but --help). None, and every command is built, when
    that word is no command: argparse's error (or help) is then the one it always gave."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in _COMMANDS else None


def _runs_on_docker(args: argparse.Namespace) -> bool:
    """Whether the command's runs use this host's Docker engine, known without reading
    a host config (that loads pydantic): `--backend docker`, or no host config at all
    (`sandbox.contracts.hostconfig`: then Docker runs everything). With a host config
    the engine is known only once it is read, and nothing is asked before."""
    if args.backend is not None:
        return bool(args.backend == "docker")
    from sandbox.contracts.hostpath import host_config_path

    return host_config_path(args.host_config) is None


def _prefetch_engine(args: argparse.Namespace) -> None:
    """Ask the engine for its API version while the command imports (see
    `sandbox.backends.docker.prefetch`). Only a speed-up: a host config path that cannot
    even be looked at asks nothing here and is the run's own error, said as usual."""
    with contextlib.suppress(OSError):
        if _runs_on_docker(args):
            from sandbox.backends.docker import prefetch

            prefetch.start()


_COMMANDS = frozenset(
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
    }
)

# The commands that run steps: a controller starts one process per run, and its
# start-up is paid by every run (see `_StartGc`).
_RUNS_STEPS = frozenset({"run", "run-workflow", "verify", "verify-workflow"})


def main(argv: list[str] | None = None) -> int:
    """The command line; `argv` None: this process's own (`sys.argv`), and the process
    is this command (the console script, `python -m sandbox.cli`)."""
    return _main(argv)[0]


def _main(argv: list[str] | None) -> tuple[int, bool]:
    """`main`: the exit code, and whether this process is a command that ran steps."""
    words = sys.argv[1:] if argv is None else argv
    command = _command_named(words)
    parser = build_parser(command)
    if command == "bench" and _bench_checkout() is None:
        parser.error(BENCH_ELSEWHERE)
    args = parser.parse_args(argv)
    start = _StartGc() if argv is None and args.command in _RUNS_STEPS else None
    args.start_gc = start
    if start is not None:
        _prefetch_engine(args)
    try:
        return _dispatch(args), start is not None
    finally:
        if start is not None:
            start.end()


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
    try:
        code: int = args.func(args)
    except SandboxError as exc:
        say(f"sandbox: error: {clean(str(exc), keep_newlines=False)}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        say("sandbox: interrupted", err=True)
        return 1
    except Exception as exc:
        # Never a traceback: one line a user can report.
        detail = clean(str(exc).splitlines()[0][:300] if str(exc) else "", keep_newlines=False)
        say(f"sandbox: internal error: {type(exc).__name__}: {detail}", err=True)
        return 2
    return code


if __name__ == "__main__":
    console()
