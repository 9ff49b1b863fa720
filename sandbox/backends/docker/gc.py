"""Removing what a crashed runner left: containers, networks, mounts, and `running` records.

A resource belongs to a live run only while the runner process named in its
labels or record (pid and start time, so a reused pid does not count) is alive. The
start is compared in clock ticks since boot, within the same boot, where the runner
recorded them: a wall-clock start moves with every clock step (`hostfs.procstart`).
Anything else labelled `sandbox.managed` is removed; a dead run's mounts (its disk,
whose loop device goes with it, and its workflow view) are unmounted and its disk
image deleted, wherever its run root is (they are found in the mount table); and
its record, if it still says `running`, is rewritten as `killed`. A whole-workflow
run is one run root with a run root per step under `steps/`: each step's is handled
as any run's, and the workflow record is marked `killed` with the step it was in. With
`remove_runs`, the folders of finished test runs of the named workflows are deleted
too, whatever the step left in them (fd-based, any depth, any names or modes).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import docker.errors
import psutil
from docker import DockerClient
from pydantic import BaseModel

from sandbox.backends.docker.containers import remove_id
from sandbox.contracts.layout import (
    DISK_MOUNT,
    STEPS_DIR,
    TEST_RUN_PREFIX,
    VIEW_LAYER,
    WORKFLOW_VIEW,
    is_test_run,
)
from sandbox.contracts.names import (
    LABEL_MANAGED,
    LABEL_RUN_ROOT,
    LABEL_RUNNER_BOOT,
    LABEL_RUNNER_PID,
    LABEL_RUNNER_START,
    LABEL_RUNNER_TICKS,
)
from sandbox.contracts.record import RECORD_FILE, RunnerInfo, RunStatus, utcnow, write_record
from sandbox.contracts.workflow_record import (
    StepState,
    WorkflowRunRecord,
    read_any_record,
    write_workflow_record,
)
from sandbox.hostfs import fdtree, hostmount, procstart
from sandbox.stepfs import disk


class GcReport(BaseModel):
    containers_removed: list[str] = []
    networks_removed: list[str] = []
    mounts_removed: list[str] = []
    records_marked_killed: list[str] = []
    # On a cluster (the Kubernetes backend): the runs' Pods and the guards' Secrets.
    pods_removed: list[str] = []
    secrets_removed: list[str] = []
    runs_removed: list[str] = []
    errors: list[str] = []


def runner_of_run_alive(run_root: Path) -> bool:
    """True while the runner named in the run's record is alive (an unreadable record: no)."""
    try:
        record = read_any_record(run_root)
    except (OSError, ValueError):
        return False
    return record_runner_alive(record.runner)


def run_ended(run_root: Path) -> bool:
    """True when the run's record has a final status, or says `running` for a dead runner."""
    try:
        record = read_any_record(run_root)
    except (OSError, ValueError):
        return not runner_of_run_alive(run_root)
    return record.status is not RunStatus.RUNNING or not runner_of_run_alive(run_root)


def roots_with_mounts() -> set[Path]:
    """Run roots (`.../runs/test-<id>`, or a chain step's `.../runs/test-<id>/steps/<n>-<step>`)
    that have a disk or view mounted below them."""
    roots = set()
    for point in hostmount.mount_points():
        path = Path(point)
        if path.name not in (DISK_MOUNT, WORKFLOW_VIEW, VIEW_LAYER):
            continue
        root = path.parent
        if (root.name.startswith(TEST_RUN_PREFIX) and root.parent.name == "runs") or (
            root.parent.name == STEPS_DIR
            and root.parent.parent.name.startswith(TEST_RUN_PREFIX)
            and root.parent.parent.parent.name == "runs"
        ):
            roots.add(root)
    return roots


def step_roots(run_root: Path) -> list[Path]:
    """A whole-workflow run's step run roots (none for a single run); links ignored."""
    steps = run_root / STEPS_DIR
    if steps.is_symlink() or not steps.is_dir():
        return []
    return sorted(p for p in steps.iterdir() if p.is_dir() and not p.is_symlink())


def runner_alive(
    pid: int, create_time: float, start_ticks: int | None = None, boot_id: str | None = None
) -> bool:
    """True when that exact process still runs: by its start in clock ticks and its boot
    when they are known (no clock step moves them), else by its wall-clock start time
    (what runners before them recorded; a clock step since makes it look dead)."""
    if start_ticks is not None and boot_id:
        return procstart.same_process(pid, start_ticks, boot_id)
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - create_time) < 0.01 and proc.status() != "zombie"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def record_runner_alive(runner: RunnerInfo | None) -> bool:
    """True while the runner a record names still runs (no runner named: no)."""
    return runner is not None and runner_alive(
        runner.pid, runner.create_time, runner.start_ticks, runner.boot_id
    )


def orphaned(labels: dict[str, str]) -> bool:
    """Whether the runner its labels name is gone; labels that do not name one, or not
    in our format, are an orphan's."""
    try:
        ticks = labels.get(LABEL_RUNNER_TICKS)
        return not runner_alive(
            int(labels[LABEL_RUNNER_PID]),
            float(labels[LABEL_RUNNER_START]),
            None if ticks is None else int(ticks),
            labels.get(LABEL_RUNNER_BOOT),
        )
    except (KeyError, ValueError):
        return True


def mark_killed(run_root: Path, *, runner_dead: bool = False, who: str = "runner") -> bool:
    """Rewrite an orphaned `running` record as `killed`; True when it did.

    `runner_dead`: the caller knows the runner ended (a fleet runner's Pod did, a
    fleet chain's controller is gone), so the record's runner, on another node, is not
    looked up here. `who`: what died, as the reason names it (a fleet chain's
    `controller`)."""
    if run_root.is_symlink() or not (run_root / RECORD_FILE).is_file():
        return False
    try:
        record = read_any_record(run_root)
    except (OSError, ValueError):
        return False
    if record.status is not RunStatus.RUNNING:
        return False
    if not runner_dead and record_runner_alive(record.runner):
        return False
    record.status = RunStatus.KILLED
    record.reason = f"the {who} died before the run finished; cleaned up by `sandbox gc`"
    record.finished_at = utcnow()
    record.duration_s = (record.finished_at - record.started_at).total_seconds()
    if isinstance(record, WorkflowRunRecord):
        _mark_chain_killed(record, who)
        write_workflow_record(run_root, record)
    else:
        write_record(run_root, record)
    return True


def _mark_chain_killed(record: WorkflowRunRecord, who: str) -> None:
    """The step the chain was in is killed with it; the steps after it never ran."""
    if record.current_step is not None:
        record.reason = (
            f"the {who} died in step {record.current_step} before the workflow run finished;"
            " cleaned up by `sandbox gc`"
        )
    for entry in record.steps:
        if entry.status is StepState.RUNNING:
            entry.status, entry.reason = StepState.KILLED, f"the {who} died during this step"
        elif entry.status is StepState.PENDING:
            entry.status, entry.reason = StepState.SKIPPED, f"the {who} died before this step"


def collect(
    client: DockerClient, workflow_dirs: list[Path] | None = None, *, remove_runs: bool = False
) -> GcReport:
    report = GcReport()
    roots: set[Path] = set()
    # The list's own labels, no inspect per container: on a shared engine a container
    # listed here may be gone (another run ended) before it could be inspected.
    for container in client.api.containers(all=True, filters={"label": LABEL_MANAGED}):
        labels = container.get("Labels") or {}
        if not orphaned(labels):
            continue
        name = ((container.get("Names") or [""])[0]).lstrip("/") or container["Id"]
        if remove_id(client.api, container["Id"]):
            report.containers_removed.append(name)
        if LABEL_RUN_ROOT in labels:
            roots.add(Path(labels[LABEL_RUN_ROOT]))
    for network in client.networks.list(filters={"label": LABEL_MANAGED}):
        labels = network.attrs.get("Labels") or {}
        if not orphaned(labels):
            continue
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            network.remove()
            report.networks_removed.append(network.name or "?")
    return collect_host(report, roots, workflow_dirs, remove_runs=remove_runs)


def collect_host(
    report: GcReport,
    roots: set[Path],
    workflow_dirs: list[Path] | None = None,
    *,
    remove_runs: bool = False,
) -> GcReport:
    """This host's part, whatever engine ran the containers (which must be gone): the
    dead runs' mounts and `running` records, found from `roots`, the workflows named and
    the mount table; with `remove_runs`, the finished runs' folders."""
    for workflow_dir in workflow_dirs or []:
        runs = workflow_dir / "runs"
        if runs.is_dir() and not runs.is_symlink():
            roots.update(
                p
                for p in runs.glob("test-*")
                if is_test_run(p.name) and p.is_dir() and not p.is_symlink()
            )
    roots |= roots_with_mounts()
    # A chain step's root brings its workflow run's, and a workflow run's its steps'.
    roots |= {root.parent.parent for root in roots if root.parent.name == STEPS_DIR}
    roots |= {step for root in list(roots) for step in step_roots(root)}
    for root in sorted(roots):
        if runner_of_run_alive(root):
            continue
        try:
            report.mounts_removed += disk.reap(root)
        except OSError as exc:
            report.errors.append(f"{root}: {exc}")
        if mark_killed(root):
            report.records_marked_killed.append(str(root))
    if remove_runs:
        for workflow_dir in workflow_dirs or []:
            _remove_finished_runs(workflow_dir / "runs", report)
    return report


def _remove_finished_runs(runs: Path, report: GcReport) -> None:
    """Delete every test run folder whose run has ended (its runner is gone)."""
    try:
        fd = fdtree.open_root(runs)
    except OSError:
        return
    try:
        with os.scandir(fd) as it:
            names = [e.name for e in it if is_test_run(e.name)]  # history kept
    finally:
        os.close(fd)
    for name in sorted(names):
        root = runs / name
        if not run_ended(root) or hostmount.mounts_below(root):
            continue
        problems = fdtree.remove_tree(root)
        if problems:
            report.errors.extend(problems[:10])
        else:
            report.runs_removed.append(str(root))
