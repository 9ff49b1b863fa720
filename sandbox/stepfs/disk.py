"""The step's disk: one file system per test run whose size is the disk quota.

The step's writable folders (its group folder, its DB copy's folder and its /tmp) are
folders of one ext4 file system made for the run: a sparse image file in the run root
(`runs/test-<id>/.disk.img`, as large as `disk_quota_mb`), loop-mounted `nosuid,nodev`
at `runs/test-<id>/.disk/` by the root runner. The kernel enforces the quota: plain,
fast, sparse, deleted-but-open and many-small-file writes all meet the same wall
(ENOSPC; the inode count is capped too), and the image can never take more of the
host's disk than its size. A cheap watcher (one `statvfs` every 20 ms, no walk) sees
the file system reach the wall and stops the step, so the run is recorded as `quota`.

At the end `export()` copies what the step left into the run folder
(`runs/test-<id>/<group>/`, `runs/test-<id>/db/`) with the link-safe, hole-keeping,
capped tree copy, and `close()` unmounts, detaches and deletes the image: no mount or
loop device outlives the run (`sandbox gc` removes a dead runner's, `reap_orphans`).
A workflow chain keeps one `StepDisk` mounted across its steps and exports once.

Limits: it needs a root runner (loop devices and mounts); a non-root runner is refused
with a clear message. "Full" is less than 2% of the quota (at least 1 MiB) left: ext4
refuses a large write before its last blocks are used. A step that fills the disk and
frees it again within one 20 ms interval is not recorded as `quota` (the disk still
never grew past the quota). The file system's own metadata takes a little of the quota
(about 2-5% on small disks).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sandbox.contracts.errors import PrepareError
from sandbox.contracts.layout import DISK_IMAGE, RunLayout
from sandbox.contracts.reports import CopyReport
from sandbox.hostfs import fdtree
from sandbox.hostfs.hostmount import (
    MS_NOATIME,
    MS_NODEV,
    MS_NOSUID,
    is_mount_point,
    mount,
    mounts_below,
    unmount,
)
from sandbox.prepare.copytree import copy_execution_tree

# One inode per 16 KiB of quota, at most this many: every host-side walk of the step's
# folders is then bounded by the file system itself.
MAX_INODES: Final = 200_000
POLL_S: Final = 0.02
# Full means: less than 2% of the quota (at least 1 MiB) is left. ext4 refuses a write
# it cannot place whole before the last blocks are used (delayed allocation keeps a
# reserve), so a writer meets ENOSPC with a little space still shown free.
FULL_SLACK_FRACTION: Final = 0.02
FULL_SLACK_MIN_BYTES: Final = 1024 * 1024

_LOOP_CTL_GET_FREE: Final = 0x4C82
_LOOP_CONFIGURE: Final = 0x4C0A
_LO_FLAGS_AUTOCLEAR: Final = 4


class DiskError(PrepareError):
    """The step's disk could not be made (not root, no loop device, mkfs failed)."""


# struct loop_info64 then struct loop_config (linux/loop.h): all fields zero but the flags
# and the file name, the backing fd, no block size (the default), reserved zeros.
_LOOP_INFO64: Final = struct.Struct("=5Q4I64s64s32s2Q")
_LOOP_CONFIG_HEAD: Final = struct.Struct("=II")


def _loop_config(backing_fd: int, name: str) -> bytes:
    info = _LOOP_INFO64.pack(
        0, 0, 0, 0, 0, 0, 0, 0, _LO_FLAGS_AUTOCLEAR, name.encode()[:63], b"", b"", 0, 0
    )
    return _LOOP_CONFIG_HEAD.pack(backing_fd, 0) + info + bytes(64)


def _attach_loop(image: Path) -> tuple[int, str]:
    """A loop device backed by ``image`` (autoclear: it goes with its last user)."""
    backing = os.open(image, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(20):
                number = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
                device = f"/dev/loop{number}"
                dev_fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.ioctl(dev_fd, _LOOP_CONFIGURE, _loop_config(backing, str(image)))
                except OSError as exc:
                    os.close(dev_fd)
                    if exc.errno == errno.EBUSY:  # taken by someone else meanwhile
                        continue
                    raise
                return dev_fd, device
            raise OSError(errno.EBUSY, "no free loop device")
        finally:
            os.close(ctl)
    finally:
        os.close(backing)


def _mkfs(image: Path, quota_bytes: int) -> None:
    inodes = max(1024, min(MAX_INODES, quota_bytes // 16384))
    args = [
        "mkfs.ext4",
        "-q",
        "-F",
        "-b",
        "4096" if quota_bytes >= 64 * 1024**2 else "1024",
        "-N",
        str(inodes),
        "-m",
        "0",
        # Nanosecond timestamps (128-byte inodes keep whole seconds): the group folder's
        # snapshot trusts an unchanged ctime (`sandbox.collect.watch`).
        "-I",
        "256",
        # No journal (the disk is thrown away), no room to grow, nothing discarded, and
        # inode tables left to read as zeros (the image starts as one hole).
        "-O",
        "^has_journal,^resize_inode",
        "-E",
        "nodiscard,lazy_itable_init=1",
        str(image),
    ]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise DiskError("mkfs.ext4 is not installed (Debian: e2fsprogs)") from None
    except subprocess.TimeoutExpired:
        raise DiskError("mkfs.ext4 took longer than 60 s") from None
    if done.returncode != 0:
        raise DiskError(f"mkfs.ext4 failed: {(done.stderr or done.stdout).strip()[:300]}")


@dataclass
class DiskUsage:
    used_bytes: int
    free_bytes: int
    free_inodes: int
    slack_bytes: int

    @property
    def full(self) -> bool:
        return self.free_bytes < self.slack_bytes or self.free_inodes == 0


class StepDisk:
    """One run's disk, from `create` to `close` (both idempotent on the way out)."""

    def __init__(self, layout: RunLayout, quota_bytes: int) -> None:
        self.quota_bytes = quota_bytes
        self.image = layout.disk_image
        self.mount_point = layout.disk_mount
        self.group_dir = layout.disk_group
        self.db_dir = layout.disk_db
        self.tmp_dir = layout.disk_tmp
        self._mounted = False
        self._metadata_bytes = 0

    @classmethod
    def create(cls, layout: RunLayout, quota_bytes: int) -> StepDisk:
        """Make, mount and lay out the disk; DiskError (nothing left behind) if it cannot."""
        if os.geteuid() != 0:
            raise DiskError(
                "the runner is not root: the step's folders live on a loop-mounted file system "
                "sized to its disk quota, which only root can mount; run sandbox as root"
            )
        disk = cls(layout, quota_bytes)
        try:
            disk._make()
        except BaseException:
            disk.close()
            raise
        return disk

    def _make(self) -> None:
        fd = os.open(self.image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, self.quota_bytes)
        finally:
            os.close(fd)
        _mkfs(self.image, self.quota_bytes)
        os.mkdir(self.mount_point, 0o755)
        try:
            dev_fd, device = _attach_loop(self.image)
        except OSError as exc:
            raise DiskError(f"cannot attach a loop device for the step's disk: {exc}") from None
        try:
            flags = MS_NOSUID | MS_NODEV | MS_NOATIME
            mount(device, self.mount_point, "ext4", flags, "noinit_itable")
            self._mounted = True
        except OSError as exc:
            raise DiskError(f"cannot mount the step's disk: {exc}") from None
        finally:
            os.close(dev_fd)  # the mount holds the device now; autoclear frees it after
        st = os.statvfs(self.mount_point)
        self._metadata_bytes = (st.f_blocks - st.f_bfree) * st.f_frsize
        root = fdtree.open_root(self.mount_point)
        try:
            os.fchmod(root, 0o755)
            folders = ((self.group_dir, 0o755), (self.db_dir, 0o755), (self.tmp_dir, 0o1777))
            for path, mode in folders:
                name = path.name
                os.mkdir(name, mode, dir_fd=root)
                os.chmod(name, mode, dir_fd=root)
        finally:
            os.close(root)

    def usage(self) -> DiskUsage:
        """What the step's folders take (the file system's own metadata not counted)."""
        st = os.statvfs(self.mount_point)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize - self._metadata_bytes
        return DiskUsage(
            used_bytes=max(0, used),
            free_bytes=st.f_bavail * st.f_frsize,
            free_inodes=st.f_favail,
            slack_bytes=max(FULL_SLACK_MIN_BYTES, int(self.quota_bytes * FULL_SLACK_FRACTION)),
        )

    def export(self, group_dest: Path, db_dest: Path | None) -> CopyReport:
        """Copy the group folder (and the DB folder) off the disk into the run folder.

        The copy is the tree copy's: links as links, special files skipped, set-id bits
        dropped, holes kept, capped at the quota; its report says what was left out."""
        report = copy_execution_tree(self.group_dir, group_dest, cap_bytes=self.quota_bytes)
        if db_dest is not None:
            db_report = copy_execution_tree(self.db_dir, db_dest, cap_bytes=self.quota_bytes)
            report.files_copied += db_report.files_copied
            report.bytes_copied += db_report.bytes_copied
            for err in db_report.errors:
                report.note_error(f"db: {err}")
        return report

    def close(self) -> None:
        """Unmount, detach and delete; safe to call at any point, and twice."""
        busy = False
        if self._mounted or is_mount_point(self.mount_point):
            busy = not unmount(self.mount_point)
            self._mounted = False
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(self.mount_point)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.image)
        if busy:
            raise OSError(
                errno.EBUSY,
                "the step's disk was still in use when unmounted; it was detached and goes "
                "with its last user",
            )


def reap(run_root: Path) -> list[str]:
    """Remove what a dead runner's run left mounted or allocated: its mounts (the loop
    device goes with its mount) and its disk image. Returns what it removed."""
    removed = []
    for point in mounts_below(run_root):
        with contextlib.suppress(OSError):
            unmount(Path(point))
            removed.append(point)
        with contextlib.suppress(OSError):
            os.rmdir(point)
    image = run_root / DISK_IMAGE
    if image.is_file() and not image.is_symlink():
        _detach_loops_of(image)
        image.unlink()
        removed.append(str(image))
    return removed


def _detach_loops_of(image: Path) -> None:
    """Detach any loop device still backed by ``image`` (an unmounted, not-yet-cleared one)."""
    for entry in Path("/sys/block").glob("loop*"):
        try:
            backing = (entry / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if backing == str(image):
            with contextlib.suppress(OSError):
                fd = os.open(f"/dev/{entry.name}", os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.ioctl(fd, 0x4C01)  # LOOP_CLR_FD
                finally:
                    os.close(fd)


class DiskWatch:
    """Stops the step when its disk is full: one `statvfs` per interval, no walk."""

    def __init__(self, disk: StepDisk, on_full: Callable[[DiskUsage], None]) -> None:
        self._disk = disk
        self._on_full = on_full
        self._stop = threading.Event()
        self.peak_bytes = 0
        self.full = False
        self._thread = threading.Thread(target=self._run, name="disk-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.check():
                return
            self._stop.wait(POLL_S)

    def check(self) -> bool:
        """One look; True (and the step stopped) once the disk was found full."""
        if self.full:
            return True
        try:
            usage = self._disk.usage()
        except OSError:
            return False
        self.peak_bytes = max(self.peak_bytes, usage.used_bytes)
        if usage.full:
            self.full = True
            self._on_full(usage)
        return self.full

    def stop(self) -> int:
        """Stop watching, with one last look; the disk's use at the end."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.check()
        try:
            return self._disk.usage().used_bytes
        except OSError:
            return self.peak_bytes


def wait_until_gone(path: Path, timeout_s: float = 5.0) -> bool:
    """True once ``path`` is no mount point any more (a lazy unmount finished)."""
    deadline = time.monotonic() + timeout_s
    while is_mount_point(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
