"""The run folder made ready for containers: the guard's folders, the MCP servers'
socket folders, the step's disk with its copies on it, the prompt, the CA bundle and
the guard's config.

Every file is made with O_EXCL | O_NOFOLLOW and every tree handed over fd-based: a
runner-made path is never followed through a link anything else could have planted.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from sandbox.contracts.config import Workflow
from sandbox.contracts.errors import PrepareError
from sandbox.contracts.guardconfig import CONFIG_FILE_NAME, GuardConfig
from sandbox.contracts.ids import NO_REMAP, IdMap
from sandbox.contracts.layout import GUARD_UID, RunLayout, make_private_dir, mcp_uid
from sandbox.contracts.record import TestRunRecord
from sandbox.contracts.recording import REPLAY_DIR
from sandbox.hostfs import fdtree
from sandbox.hostfs.fdcopy import copy_fd
from sandbox.prepare.copytree import copy_execution_tree
from sandbox.prepare.dbcopy import DbCopyError, copy_db
from sandbox.prepare.inputs import Seed
from sandbox.prepare.plan import EgressCA, RunPlan, stdio_servers, step_user
from sandbox.prepare.prompt import with_test_mode_section
from sandbox.prepare.replaysource import copy_recording
from sandbox.stepfs import lifecycle as stepfs


@dataclass(frozen=True)
class Prepared:
    """The run folder ready for containers: the step's disk mounted and filled."""

    plan: RunPlan
    files: stepfs.StepFs


def make_run_root(layout: RunLayout) -> None:
    """`runs/test-<id>/`, private, never made through a link at `runs/`."""
    runs = layout.runs_dir
    if runs.is_symlink():
        raise PrepareError(f"{runs} is a symlink; refusing to create a test run through it")
    runs.mkdir(exist_ok=True)
    try:
        make_private_dir(layout.root)
    except OSError as exc:
        raise PrepareError(f"cannot create {layout.root}: {exc}") from None


def prepare_guard(plan: RunPlan, record: TestRunRecord) -> None:
    """What the guard's container mounts and reads at its start: its log file and its
    folder (with the recording a replay reads), the stdio servers' socket folders.
    Nothing of the step's: the guard's container may start before the step's disk is
    made (`prepare_step`), and the step's container only once it is."""
    layout, ids = plan.layout, plan.ids
    # Host ids: what the engine's user namespace shows the guard as its own.
    guard_uid, guard_gid = ids.host_uid(GUARD_UID), ids.host_gid(GUARD_UID)
    # The guard's alone: no other uid of the run may write (or read) it.
    layout.actions.touch(mode=0o600)
    make_private_dir(layout.guard_dir, 0o700)
    if os.geteuid() == 0:
        os.chown(layout.actions, guard_uid, guard_gid, follow_symlinks=False)
        os.chown(layout.guard_dir, guard_uid, guard_gid, follow_symlinks=False)
    if plan.replay_from is not None:  # root's, read-only to the guard
        record.replay = copy_recording(
            plan.replay_from, layout.guard_dir / REPLAY_DIR, plan.recording.cap_bytes
        )
    prepare_mcp(plan.workflow, layout, ids)


def prepare_step(
    plan: RunPlan,
    files: stepfs.StepFs,
    seed: Seed,
    prompt: str | None,
    record: TestRunRecord,
) -> Prepared:
    """The step's disk with the copies on it, its view of the workflow, the prompt and
    the CA bundle (before any container that trusts it exists); the copy and DB-copy
    reports go into the record. After `prepare_guard`."""
    workflow, layout, ids = plan.workflow, plan.layout, plan.ids
    step_uid, step_gid = step_user()
    # Host ids: what the engine's user namespace shows the step as its own.
    uid, gid = ids.host_uid(step_uid), ids.host_gid(step_gid)
    disk = files.open()
    t0 = time.monotonic()
    source = seed.group
    if source is None:
        record.no_earlier_run = True
    else:
        record.copy_report = copy_execution_tree(
            source, disk.group_dir, cap_bytes=workflow.limits.copy_cap_mb * 1024**2
        )
    chown_tree(disk.group_dir, uid, gid)
    record.phases.copy_s = time.monotonic() - t0

    t0 = time.monotonic()
    if seed.db is None:
        record.no_db = True
    else:
        # The pristine copy (for the diff) is made first, off the step's disk; the
        # step's copy is a copy of it, on the disk.
        make_private_dir(layout.baseline_db.parent, 0o700)
        try:
            record.db_copy = copy_db(seed.db, layout.baseline_db)
            copy_file(layout.baseline_db, disk.db_dir / layout.db_path.name)
        except DbCopyError as exc:
            raise PrepareError(f"workflow DB cannot be copied: {exc}") from None
        except OSError as exc:
            raise PrepareError(f"workflow DB copy does not fit the step's disk: {exc}") from None
        record.db_copy = record.db_copy.model_copy(update={"dest": str(layout.db_path)})
        chown_tree(disk.db_dir, uid, gid)
    record.phases.db_copy_s = time.monotonic() - t0
    files.snapshot_before()

    if prompt is not None:
        layout.prompt.write_text(with_test_mode_section(prompt), encoding="utf-8")
        layout.prompt.chmod(0o644)
    if plan.egress_ca is not None:  # before any container that trusts it exists
        trust_egress_ca(layout, plan.egress_ca)
    return Prepared(plan=plan, files=files)


def prepare_mcp(workflow: Workflow, layout: RunLayout, ids: IdMap) -> None:
    """Per stdio server, a folder for the guard's sockets: the guard's, and only that
    server's group may pass (setgid, so the sockets are that group's); the step and
    the other servers cannot. Their stderr goes to a root-only folder at the end."""
    servers = stdio_servers(workflow)
    if not servers:
        return
    make_private_dir(layout.mcp_dir, 0o700)
    make_private_dir(layout.mcp_stderr_dir, 0o700)
    root = os.geteuid() == 0
    if root:
        os.chown(
            layout.mcp_dir,
            ids.host_uid(GUARD_UID),
            ids.host_gid(GUARD_UID),
            follow_symlinks=False,
        )
    for index, server in servers:
        folder = layout.mcp_server_dir(server.name)
        make_private_dir(folder, 0o700)
        if root:
            os.chown(
                folder,
                ids.host_uid(GUARD_UID),
                ids.host_gid(mcp_uid(index)),
                follow_symlinks=False,
            )
            os.chmod(folder, 0o2710, follow_symlinks=False)


def trust_egress_ca(layout: RunLayout, ca: EgressCA) -> None:
    """The step (and any MCP server whose egress is inspected) trusts this run's CA
    (its certificate only) beside the system's."""
    system = Path("/etc/ssl/certs/ca-certificates.crt")
    bundle = (system.read_bytes() if system.is_file() else b"") + b"\n" + ca.cert_pem.encode()
    fd = os.open(layout.ca_bundle, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(bundle)


def copy_file(src: Path, dst: Path) -> None:
    """A runner-made file into a new file (holes kept); neither end is followed."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    src_fd = os.open(src, os.O_RDONLY | flags)
    try:
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o644)
        try:
            copy_fd(src_fd, dst_fd)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give the step its folder without following any link inside it (fd-based, any depth)."""
    if os.geteuid() != 0:
        return
    fdtree.chown_tree(root, uid, gid)


def write_guard_config(layout: RunLayout, config: GuardConfig, ids: IdMap = NO_REMAP) -> None:
    """The guard's config, in its own folder (never its environment; see contracts.guardconfig),
    readable by the guard's uid only (the host uid it has under the engine's `ids`)."""
    path = layout.guard_dir / CONFIG_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(config.model_dump_json())
    if os.geteuid() == 0:
        os.chown(path, ids.host_uid(GUARD_UID), ids.host_gid(GUARD_UID), follow_symlinks=False)
