"""Removing what a crashed runner left: containers, networks, and `running` records.

A resource belongs to a live run only while the runner process named in its
labels (pid and start time, so a reused pid does not count) is alive. Anything
else labelled `sandbox.managed` is removed, and its run's record, if it still
says `running`, is rewritten as `killed`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import docker.errors
import psutil
from docker import DockerClient
from pydantic import BaseModel

from sandbox.engine.containers import (
    LABEL_MANAGED,
    LABEL_RUN_ROOT,
    LABEL_RUNNER_PID,
    LABEL_RUNNER_START,
)
from sandbox.record import RECORD_FILE, RunStatus, read_record, utcnow, write_record


class GcReport(BaseModel):
    containers_removed: list[str] = []
    networks_removed: list[str] = []
    records_marked_killed: list[str] = []


def runner_alive(pid: int, create_time: float) -> bool:
    """True when that exact process (pid and start time) still runs."""
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - create_time) < 0.01 and proc.status() != "zombie"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def orphaned(labels: dict[str, str]) -> bool:
    try:
        return not runner_alive(int(labels[LABEL_RUNNER_PID]), float(labels[LABEL_RUNNER_START]))
    except (KeyError, ValueError):
        return True


def mark_killed(run_root: Path) -> bool:
    """Rewrite an orphaned `running` record as `killed`; True when it did."""
    if run_root.is_symlink() or not (run_root / RECORD_FILE).is_file():
        return False
    try:
        record = read_record(run_root)
    except (OSError, ValueError):
        return False
    if record.status is not RunStatus.RUNNING:
        return False
    if record.runner is not None and runner_alive(record.runner.pid, record.runner.create_time):
        return False
    record.status = RunStatus.KILLED
    record.reason = "the runner died before the run finished; cleaned up by `sandbox gc`"
    record.finished_at = utcnow()
    record.duration_s = (record.finished_at - record.started_at).total_seconds()
    write_record(run_root, record)
    return True


def collect(client: DockerClient, workflow_dirs: list[Path] | None = None) -> GcReport:
    report = GcReport()
    roots: set[Path] = set()
    for container in client.containers.list(all=True, filters={"label": LABEL_MANAGED}):
        labels = container.labels or {}
        if not orphaned(labels):
            continue
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True, v=True)
            report.containers_removed.append(container.name or container.id or "?")
        if LABEL_RUN_ROOT in labels:
            roots.add(Path(labels[LABEL_RUN_ROOT]))
    for network in client.networks.list(filters={"label": LABEL_MANAGED}):
        labels = network.attrs.get("Labels") or {}
        if not orphaned(labels):
            continue
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            network.remove()
            report.networks_removed.append(network.name or "?")
    for workflow_dir in workflow_dirs or []:
        runs = workflow_dir / "runs"
        if runs.is_dir() and not runs.is_symlink():
            roots.update(p for p in runs.glob("test-*") if p.is_dir() and not p.is_symlink())
    for root in sorted(roots):
        if mark_killed(root):
            report.records_marked_killed.append(str(root))
    return report
