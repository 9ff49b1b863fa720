"""The workflow folder as a run's containers see it: real, read-only, minus what is not theirs.

Every container of a run gets `/workflow` from one read-only overlay the runner mounts
at `runs/test-<id>/.view/`: its lower layers are a small layer of whiteouts (a tiny
tmpfs at `.view-hidden/`: a layer must not be a folder of the layer below it) over the
real workflow folder. The whiteouts leave out `db/` (the real
DB, its WAL and SHM: a read-only mount still takes SQLite locks, so a step that could
see it could stall the real workflow's writers) and every `runs/test-*` folder (earlier
test runs' records, logs and copies, and this run's own). Everything else is the real
folder, read as it is: `code/`, `knowledgebase/`, the real runs.

Cost: two mounts per run (the layer and the overlay), plus one whiteout (a `mknod`, no
mount) per test-run folder present at the start, so hundreds of old test runs add
milliseconds, not mounts; the containers get one bind mount whatever the count. Test
runs cannot appear while the view is up (a test run holds the workflow's lock alone).
The view is unmounted at the end of the run (`sandbox gc` removes a dead runner's).

Limits: needs a root runner (overlay mounts); the view follows later changes of the real
folder only as overlayfs does (a real run cannot run beside a test run anyway).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from sandbox.contracts.errors import PrepareError
from sandbox.contracts.layout import TEST_RUN_PREFIX, RunLayout
from sandbox.hostfs import fdtree
from sandbox.hostfs.hostmount import MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_RDONLY, mount, unmount

HIDDEN_TOP = ("db",)


def _escape(path: str) -> str:
    """An overlay mount option value: its separators (`\\`, `:`, `,`) escaped."""
    return path.replace("\\", "\\\\").replace(":", "\\:").replace(",", "\\,")


def _whiteout(dir_fd: int, name: str) -> None:
    os.mknod(name, 0o600 | 0o020000, os.makedev(0, 0), dir_fd=dir_fd)


def _same_owner_and_mode(fd: int, real: Path) -> None:
    st = os.stat(real, follow_symlinks=False)
    os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, stat.S_IMODE(st.st_mode))


def _test_runs(runs_dir: Path) -> list[str]:
    try:
        fd = fdtree.open_root(runs_dir)
    except FileNotFoundError:
        return []
    try:
        with os.scandir(fd) as it:
            return [e.name for e in it if e.name.startswith(TEST_RUN_PREFIX)]
    finally:
        os.close(fd)


def mount_view(layout: RunLayout) -> None:
    """Make the whiteout layer and mount the view; PrepareError if the host cannot."""
    if os.geteuid() != 0:
        raise PrepareError(
            "the runner is not root: the step's view of the workflow folder is an overlay "
            "mount, which only root can make; run sandbox as root"
        )
    layer, view = layout.view_layer, layout.workflow_view
    hidden = _test_runs(layout.runs_dir)
    os.mkdir(layer, 0o700)
    try:
        size = f"size=64k,nr_inodes={len(hidden) + 16},mode=0700"
        mount("tmpfs", layer, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, size)
    except OSError as exc:
        raise PrepareError(f"cannot mount the step's view of the workflow folder: {exc}") from None
    fd = fdtree.open_root(layer)
    try:
        # A merged folder takes its owner and mode from the top layer that has it: the
        # layer's folders copy the real ones'.
        _same_owner_and_mode(fd, layout.workflow_dir)
        for name in HIDDEN_TOP:
            _whiteout(fd, name)
        os.mkdir("runs", 0o700, dir_fd=fd)
        runs_fd = os.open("runs", fdtree.DIR_FLAGS, dir_fd=fd)
        try:
            _same_owner_and_mode(runs_fd, layout.runs_dir)
            for name in hidden:
                _whiteout(runs_fd, name)
        finally:
            os.close(runs_fd)
    finally:
        os.close(fd)
    os.mkdir(view, 0o755)
    lower = f"{_escape(str(layer))}:{_escape(str(layout.workflow_dir))}"
    options = f"lowerdir={lower},redirect_dir=nofollow,metacopy=off"
    try:
        mount("overlay", view, "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV, options)
    except OSError as exc:
        raise PrepareError(f"cannot mount the step's view of the workflow folder: {exc}") from None


def unmount_view(layout: RunLayout) -> None:
    """Unmount the view and remove its layer; safe at any point, and twice."""
    for path in (layout.workflow_view, layout.view_layer):
        if path.is_dir() and not path.is_symlink():
            unmount(path)
            with contextlib.suppress(OSError):
                os.rmdir(path)
