"""The collect phase: everything the run left, read in the order that keeps it true.

The engine's view of the containers before they go, the action log sealed once the
guard is gone, the servers' output saved by the host, the step's disk read once
nothing writes it, then the DB diff and the action summary. A run that ends early
still keeps what its servers said and what its step left (`collect_mcp_early`,
`close_files`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sandbox.backends import Backend, RunContainer
from sandbox.collect import logseal, recorded, stepreports
from sandbox.collect.guarding import Guarded
from sandbox.contracts.errors import internal_reason
from sandbox.contracts.layout import RunLayout
from sandbox.contracts.record import McpServerReport, TestRunRecord, write_record
from sandbox.contracts.reports import DbDiff
from sandbox.hostfs import fdtree
from sandbox.launch import specs as launch
from sandbox.launch.start import Launched, McpJobs
from sandbox.prepare.rundir import Prepared
from sandbox.stepfs import lifecycle as stepfs
from sandbox.stopsignals import HeldPool

if TYPE_CHECKING:
    from sandbox.collect import actionsummary

MCP_STDERR_CAP_BYTES = 2 * launch.MCP_LOG_BYTES  # the engine keeps about MCP_LOG_BYTES

# What only the collect phase reads (the action log's summary, its stub groups and the
# policy they classify with): imported while the run waits on the engine, not before
# its first container (`warm_up`), and where it is used.
_COLLECT_MODULES = ("sandbox.collect.actionsummary", "sandbox.policy")


def warm_up() -> None:
    """Import what only the collect phase needs, in a thread, while the launch waits on
    the engine (the guard's start is a quarter of a second of idle runner): a new
    `sandbox run` process spends that CPU beside the wait instead of before its first
    container. Only a speed-up: `collect` imports the same modules itself, and Python's
    import lock makes it wait for an import the thread has under way."""

    missing = [name for name in _COLLECT_MODULES if name not in sys.modules]
    if not missing:
        return  # a warm process (run after run through the API) has them

    def load() -> None:
        for name in missing:
            with contextlib.suppress(Exception):  # the collect's own import says it
                importlib.import_module(name)

    threading.Thread(target=load, name="collect-imports", daemon=True).start()


@dataclass(frozen=True)
class Collected:
    """What the record's verdict is drawn from, every container gone."""

    guard_running: bool
    guard_exit: int | None
    oom_killed: bool
    disk_full: bool
    actions: actionsummary.ActionSummary


def collect(
    backend: Backend,
    prepared: Prepared,
    launched: Launched,
    guarded: Guarded,
    record: TestRunRecord,
) -> Collected:
    """Read everything the run left, in the order that keeps it true: the engine's
    view of the containers before they go, the step's disk once nothing writes it."""
    from sandbox.collect import actionsummary

    plan, files, layout = prepared.plan, prepared.files, prepared.plan.layout
    guarded.exit_watch.cancel()
    guard_state = launched.guard.state()
    step_state = launched.step.state()
    record.stdout, record.stderr = launched.step.output_tails()
    # The step's state and output are read: where containers go one by one, its
    # container goes while the guard stops and its log is read (the step first: it
    # shares the guard's network namespace), then the guard's; the servers' go, beside
    # each other, once their output is read. The step's disk and view are unmounted
    # once every container that mounts them (the step, the servers) is gone, while the
    # guard's removal may still run: it mounts neither (its log and its data folder
    # only, `sandbox.launch.specs.guard_spec`). Where they go only together (one Pod),
    # they go at that same point, all at once. Leaving the pool waits for every
    # removal on every way out, a stop included; anything a removal left is the run's
    # clean-up's (`remove_all`, before the disk is unmounted).
    each = backend.removes_each
    with HeldPool(max_workers=2 + len(launched.mcp), thread_name_prefix="remove") as removal:
        step_gone = removal.submit(backend.remove_ahead, launched.step) if each else None
        launched.guard.stop()
        if guarded.follower is not None:
            guarded.follower.stop()  # the guard is gone: every line it wrote is read
        # The seal: nothing writes the log any more; synced by the runner whatever the
        # guard did (a failure leaves the record unsealed: it then verifies nothing).
        with contextlib.suppress(OSError):
            record.log_synced_at = logseal.seal_log(layout.root, layout.actions.name)
        record.guard_log = launched.guard.output_tails()[1]
        guard_gone = (
            removal.submit(_after, step_gone, backend.remove_ahead, launched.guard)
            if step_gone is not None
            else None
        )
        recorded.summarize(layout, plan.recording, record)  # the guard is gone: its index is whole
        record.preflight = stepreports.preflight_from(record.stderr.text, plan.install_firewall)
        record.landlock = stepreports.landlock_from(record.stderr.text)
        record.walls = stepreports.judge_walls(record.walls, record.preflight, record.landlock)
        guarded.usage.finish()
        record.resources = stepreports.resources(
            guarded.usage, record.stderr.text, executor_sees_memory=plan.step_runtime == "runc"
        )
        record.stderr = stepreports.without_reports(record.stderr)
        # What the servers said is read from the engine before their containers go.
        record.mcp_servers = collect_mcp(layout, launched.mcp)
        # The step is dead: nothing writes its disk any more (the servers see only the
        # workflow's view, read-only). The containers go while the step's folders move
        # off the disk into the run folder and the DB and the log are read.
        record.node = backend.node()
        if step_gone is not None:
            mounting = [
                step_gone,
                *(removal.submit(backend.remove_ahead, c) for c in launched.mcp.values()),
            ]
        else:
            mounting = [removal.submit(backend.remove_all)]
        collected = files.collect(has_db=not record.no_db)
        record.db_diff = db_diff(layout, record)
        actions = actionsummary.read(layout.actions)
        for job in mounting:
            job.result()  # what a removal raised, as when it ran here
        files.close()
        if guard_gone is not None:
            guard_gone.result()
            backend.remove_all()  # whatever else is left: nothing, every one went ahead
    record.disk_used_bytes = collected.peak_bytes
    record.files = collected.files
    record.export_report = collected.export
    record.stubbed, record.stubbed_cut = actions.stubbed, actions.stubbed_cut
    record.actions = actions.counts
    record.egress = actions.egress
    record.dns = actions.dns
    record.packets = actions.packets
    record.outcome_unknown = actions.outcome_unknown
    return Collected(
        guard_running=guard_state.running,
        guard_exit=guard_state.exit_code,
        oom_killed=step_state.oom_killed,
        disk_full=collected.full,
        actions=actions,
    )


def _after(first: Future[None], remove: Callable[[RunContainer], None], c: RunContainer) -> None:
    """`remove(c)` once `first` (a removal) ended, however it ended: whoever waits for
    `first` is told what it raised."""
    futures.wait([first])
    remove(c)


def collect_mcp(layout: RunLayout, mcp: dict[str, RunContainer]) -> dict[str, McpServerReport]:
    """Each server's exit and its output, saved by the host into mcp-stderr/ (root
    only, a folder no container sees): the folder is opened once without following a
    link, and each file is made in it with O_EXCL | O_NOFOLLOW, never through a path."""
    reports: dict[str, McpServerReport] = {}
    try:
        folder_fd: int | None = fdtree.open_root(layout.mcp_stderr_dir)
    except OSError:
        folder_fd = None
    try:
        for name, container in sorted(mcp.items()):
            state = container.state()
            user = container.user.partition(":")[0]
            report = McpServerReport(
                uid=int(user) if user.isdigit() else -1,
                exit_code=None if state.running else state.exit_code,
            )
            reports[name] = report
            if folder_fd is None:
                continue
            try:
                fd = os.open(
                    f"{name}.log",
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=folder_fd,
                )
            except OSError:
                continue
            try:
                size, cut = container.save_output(fd, MCP_STDERR_CAP_BYTES)
            finally:
                os.close(fd)
            reports[name] = report.model_copy(
                update={
                    "stderr_file": f"{layout.mcp_stderr_dir.name}/{name}.log",
                    "stderr_bytes": size,
                    "stderr_truncated": cut,
                }
            )
    finally:
        if folder_fd is not None:
            os.close(folder_fd)
    return reports


def db_diff(layout: RunLayout, record: TestRunRecord) -> DbDiff | None:
    """dbdiff reads both files into private copies (holes kept, size-capped) without
    following links. (Imported here: a run without a DB never loads it.)"""
    if record.no_db:
        return None
    from sandbox.collect import dbdiff

    # Its private copies live in the run root: on the workflow's disk, gone after.
    return dbdiff.diff_databases(layout.baseline_db, layout.db_path, work_dir=layout.root)


def collect_mcp_early(layout: RunLayout, record: TestRunRecord, jobs: McpJobs) -> None:
    """A run that ended before its collect phase keeps what its servers said (best
    effort: the clean-up after it must run whatever the engine says)."""
    if record.mcp_servers:
        return
    started = {
        name: job.result() for name, job in jobs.items() if job.done() and job.exception() is None
    }
    if started:
        with contextlib.suppress(Exception):
            record.mcp_servers = collect_mcp(layout, started)
            write_record(layout.root, record)


def close_files(
    layout: RunLayout, record: TestRunRecord, files: stepfs.StepFs, step_started: bool
) -> None:
    """Unmount the run's disk and view; a failure to is said in the record.

    A run that ended early after its step started still gets what the step left
    copied into the run folder first (best effort: the copy is capped and link-safe
    whatever state the step left the disk in)."""
    try:
        if step_started and files.disk is not None and not files.collected:
            with contextlib.suppress(Exception):
                record.export_report = files.collect(has_db=not record.no_db).export
                write_record(layout.root, record)
        files.close()
    except Exception as exc:
        record.reason += ("; " if record.reason else "") + internal_reason("clean-up", exc)
        write_record(layout.root, record)
