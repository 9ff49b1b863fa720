"""`show`, `report`, `list`: reading finished runs, never running one.

A run folder that is missing or whose record does not parse is a configuration error
(exit 4) naming the file; an unsealed record is shown with a warning and gets no report.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandbox.cli.output import emit, print_record, say, say_line
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.status import RECORD_FILE, REPORT_FILE, RunStatus

if TYPE_CHECKING:
    from sandbox.contracts.workflow_record import AnyRecord


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
    if args.json:
        emit({"report": str(out)})
    else:
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
    print_record(record, args.json)
    from sandbox.verify.seal import unsealed

    if why := unsealed(record):
        say(f"warning: {why}", err=True)
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """0: no difference, 1: the runs differ (as diff(1)); a run that cannot be compared is
    a configuration error."""
    from sandbox.verify.compare import compare

    result = compare(Path(args.run_a), Path(args.run_b))
    if args.json:
        emit(result)
    else:
        for line in result.lines():
            say_line(line)
    return 0 if result.same else 1


def _listed_status(record: AnyRecord) -> tuple[str, str]:
    """The status to list and why: `running` only while its runner lives; else what
    `sandbox gc` will record."""
    from sandbox.backends.docker.gc import record_runner_alive

    if record.status is RunStatus.RUNNING and not record_runner_alive(record.runner):
        return RunStatus.KILLED.value, "its runner is gone; `sandbox gc` records it"
    return record.status.value, ""


def _runs(workflow_dir: Path) -> list[dict[str, Any]]:
    """One entry per run folder, oldest first: real runs, test runs and chains."""
    from sandbox.contracts.layout import TEST_RUN_PREFIX, is_test_run
    from sandbox.contracts.workflow_record import WorkflowRunRecord, read_any_record

    runs = workflow_dir / "runs"
    if not runs.is_dir():
        raise ConfigError(f"no runs folder in {workflow_dir}")
    out: list[dict[str, Any]] = []
    for path in sorted(p for p in runs.iterdir() if p.is_dir() and not p.is_symlink()):
        if path.name.startswith(TEST_RUN_PREFIX) and not is_test_run(path.name):
            continue  # the verification history's folder, listed below
        if not is_test_run(path.name):
            out.append({"kind": "real_run", "run_id": path.name})
            continue
        try:
            record = read_any_record(path)
        except (OSError, ValueError):
            out.append({"kind": "test_run", "run_id": path.name, "status": None})
            continue
        status, note = _listed_status(record)
        entry: dict[str, Any] = {"run_id": path.name, "status": status, "note": note}
        if isinstance(record, WorkflowRunRecord):
            entry |= {"kind": "workflow_test_run", "steps": [s.step_id for s in record.steps]}
        else:
            entry |= {"kind": "test_run", "step_id": record.step_id}
        out.append(entry)
    return out


def cmd_list(args: argparse.Namespace) -> int:
    from sandbox.verify import history

    workflow_dir = Path(args.workflow_dir)
    runs = _runs(workflow_dir)
    entries = history.read(workflow_dir)
    chains = history.read_workflow(workflow_dir)
    if args.json:
        for run in runs:
            emit(run)
        for entry in entries:
            emit({"kind": "verification", **entry.model_dump(mode="json")})
        for verified in chains:
            emit({"kind": "workflow_verification", **verified.model_dump(mode="json")})
        return 0
    for run in runs:
        say_line(_run_line(run))
    if entries:
        say("verifications (oldest first):")
    for entry in entries:
        verdict = "pass" if entry.passed else "FAIL: " + "; ".join(entry.failed[:3])
        digest = entry.content.digest[:12] if entry.content else "?"
        say(
            f"  {entry.at:%Y-%m-%d %H:%M:%S}  {entry.step_id}  {verdict}  "
            f"hash {digest}  {entry.run_id}"
        )
    if chains:
        say("workflow verifications (oldest first):")
    for verified in chains:
        verdict = "pass" if verified.passed else "FAIL: " + "; ".join(verified.failed[:3])
        say(
            f"  {verified.at:%Y-%m-%d %H:%M:%S}  {' -> '.join(verified.chain_steps)}  "
            f"{verified.expectations_file}  {verdict}  {verified.run_id}"
        )
    return 0


def _run_line(run: dict[str, Any]) -> str:
    if run["kind"] == "real_run":
        return f"{run['run_id']}  [real run]"
    if run["status"] is None:
        return f"{run['run_id']}  [test run]  (no readable record)"
    status = f"{run['status']} ({run['note']})" if run["note"] else run["status"]
    if run["kind"] == "workflow_test_run":
        return f"{run['run_id']}  [workflow test run]  {' -> '.join(run['steps'])}  {status}"
    return f"{run['run_id']}  [test run]  {run['step_id']}  {status}"
