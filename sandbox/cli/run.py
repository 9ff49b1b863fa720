"""`run`, `run-workflow`, `verify`, `verify-workflow`: the commands that run steps.

Each ends with the exit code of what happened (`sandbox.contracts.exitcodes`): a run by
its record's status, a verification by its verdict, except that a refused run (3), a
run that ended `error` (7) and a stopped runner (130) say so the same way whether it
was `run` or `verify`. With `--follow --json` stdout is JSON lines: the events
(`sandbox.contracts.events`), then the record or verdict, one object per line.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from sandbox.cli.output import emit, error, print_record, say_line
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.exitcodes import ExitCode
from sandbox.contracts.status import RunStatus

if TYPE_CHECKING:
    from sandbox.backends import BackendFactory
    from sandbox.cli.startup import StartGc
    from sandbox.progress import FollowPrinter
    from sandbox.run.testrun import RunOptions
    from sandbox.run.workflowrun import WorkflowOptions
    from sandbox.verify.against import VerifiedAgainst
    from sandbox.verify.verification import Verification
    from sandbox.verify.workflow_verification import WorkflowVerification


EXIT_BY_STATUS = {
    RunStatus.PASSED: ExitCode.OK,
    RunStatus.FAILED: ExitCode.FAILED,
    RunStatus.TIMEOUT: ExitCode.FAILED,
    RunStatus.KILLED: ExitCode.FAILED,
    RunStatus.QUOTA: ExitCode.FAILED,
    RunStatus.ERROR: ExitCode.RUN_ERROR,
    RunStatus.REFUSED: ExitCode.REFUSED,
    RunStatus.RUNNING: ExitCode.FAILED,
}

_stopped: list[int] = []  # the stop signals this process acted on


def stopped() -> bool:
    """Whether a stop signal (SIGINT, SIGTERM) was acted on: the command exits 130."""
    return bool(_stopped)


def _stop_on_signals() -> None:
    """SIGTERM ends the run as `killed` (RunInterrupted), SIGINT as Python's ^C does; both
    held back where a container is being created or counted (`sandbox.stopsignals`)."""
    from sandbox import stopsignals
    from sandbox.run.testrun import RunInterrupted

    _stopped.clear()  # a caller of `main([...])` may run several commands

    def raising(signum: int, exc: Callable[[], BaseException]) -> Callable[[], BaseException]:
        def stop() -> BaseException:
            _stopped.append(signum)
            return exc()

        return stop

    stopsignals.on_stop(signal.SIGTERM, raising(signal.SIGTERM, RunInterrupted))
    stopsignals.on_stop(signal.SIGINT, raising(signal.SIGINT, KeyboardInterrupt))


def _run_options(args: argparse.Namespace, printer: FollowPrinter | None) -> RunOptions:
    from sandbox.run.testrun import RunOptions

    durability = recording = None  # the run reads the host's config itself
    if getattr(args, "host_config", None) is not None:
        from sandbox.contracts.hostconfig import load_host_config

        host = load_host_config(args.host_config)
        durability, recording = host.durability, host.recording
    return RunOptions(
        replay=getattr(args, "replay", None),
        replay_miss=getattr(args, "replay_miss", "stub"),
        recording=recording,
        durability=durability,
        timeout_s=args.timeout,
        upstream_bridge=args.upstream_bridge,
        upstream_networks=tuple(args.upstream_network),
        allow_hosts=tuple(args.allow_host),
        canary=args.canary,
        step_runtime=args.step_runtime,
        on_event=printer,
    )


def _workflow_options(args: argparse.Namespace, printer: FollowPrinter | None) -> WorkflowOptions:
    from sandbox.run.workflowrun import WorkflowOptions

    return WorkflowOptions(
        from_step=args.from_step,
        to_step=args.to_step,
        keep_going=args.keep_going,
        step=_run_options(args, printer),
    )


def _backend(args: argparse.Namespace) -> BackendFactory | None:
    """The backend `--backend`/`--host-config` name; None leaves it to the host's config
    (the run's default factory), unless start-up waits for the connection."""
    start: StartGc | None = getattr(args, "start_gc", None)
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


def _stopped_unnamed(args: argparse.Namespace) -> int:
    """A fleet run stopped before its runner named it: no record to print."""
    error(
        ExitCode.INTERRUPTED,
        "stopped before the runner named its run; the Job is deleted (a record it began "
        "is under runs/ on the claim)",
        as_json=args.json,
    )
    return ExitCode.INTERRUPTED


def cmd_run(args: argparse.Namespace) -> int:
    from sandbox.cli.fleetrun import fleet_config, run_on_fleet
    from sandbox.run.testrun import TestRun

    _stop_on_signals()
    fleet = fleet_config(args)
    if fleet is not None:
        with _follow(args) as printer:
            placed = run_on_fleet(args, fleet, printer)
        if placed is None:
            return _stopped_unnamed(args)
        print_record(placed, args.json)
        return EXIT_BY_STATUS[placed.status]
    with _follow(args) as printer:
        options = _run_options(args, printer)
        record = TestRun(
            Path(args.workflow_dir), args.step_id, options, backend=_backend(args)
        ).execute()
    print_record(record, args.json)
    return EXIT_BY_STATUS[record.status]


def cmd_run_workflow(args: argparse.Namespace) -> int:
    from sandbox.cli.fleetrun import chain_on_fleet, fleet_config
    from sandbox.run.workflowrun import WorkflowRun

    _stop_on_signals()
    fleet = fleet_config(args)
    with _follow(args) as printer:
        if fleet is not None:
            record = chain_on_fleet(args, fleet, printer)
        else:
            options = _workflow_options(args, printer)
            record = WorkflowRun(Path(args.workflow_dir), options, backend=_backend(args)).execute()
    print_record(record, args.json)
    return EXIT_BY_STATUS[record.status]


def cmd_verify(args: argparse.Namespace) -> int:
    from sandbox.verify.junit import write_junit
    from sandbox.verify.verifystep import verify_step

    if args.against:
        from sandbox.verify.against import check_named, verify_against

        check_named(Path(args.workflow_dir), args.against)
    from sandbox.cli.fleetrun import fleet_config, verify_on_fleet

    _stop_on_signals()
    fleet = fleet_config(args)
    with _follow(args) as printer:
        if fleet is not None:
            placed = verify_on_fleet(args, fleet, printer)
            if placed is None:
                return _stopped_unnamed(args)
            verification = placed
        else:
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
    from sandbox.cli.fleetrun import fleet_config
    from sandbox.verify.junit import write_workflow_junit
    from sandbox.verify.verifyworkflow import verify_workflow

    if fleet_config(args) is not None:
        raise ConfigError(
            "verify-workflow does not run on the fleet (placement = 'scheduler'): verify "
            "each step with `sandbox verify`, or run it on a host of its own"
        )
    _stop_on_signals()
    with _follow(args) as printer:
        options = _workflow_options(args, printer)
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
    verdict printed (a JSON line or terminal-safe lines), and the exit code."""
    if args.html:
        from sandbox.verify.finished import load_run
        from sandbox.verify.html import write_report

        run_root = Path(args.workflow_dir) / "runs" / verification.run_id
        against = getattr(verification, "comparison", None)
        write_report(load_run(run_root), Path(args.html), against)
    if args.json:
        emit(verification)
    else:
        for line in verification.lines():
            say_line(line)
    return verdict_exit(verification.passed, verification.digest.status)


def verdict_exit(passed: bool, status: str) -> ExitCode:
    """A verdict's exit code: 0 when it held; a refused run or one that ended `error` as
    `run` says it; else 1 (not verified)."""
    if passed:
        return ExitCode.OK
    try:
        by_status = EXIT_BY_STATUS[RunStatus(status)]
    except ValueError:
        return ExitCode.FAILED
    return by_status if by_status in (ExitCode.REFUSED, ExitCode.RUN_ERROR) else ExitCode.FAILED
