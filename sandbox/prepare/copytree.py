"""Copy a tree capped and link-safe: a real run's ``execution/`` tree into a test run's group
folder, and the step's folders off its disk into the run folder at the end.

Guarantees: no symlink is ever followed (links are re-created from their text), special files
are skipped, setuid/setgid/sticky bits are stripped, holes stay holes (a file costs the cap what
it occupies, not its apparent size), copied bytes never exceed the cap, at most ``max_entries``
entries are looked at, a chain of folders of any depth is copied without recursion, and every
left-out file or unreadable entry is reported instead of raised (lists capped at
``MAX_LISTED``, counts exact). Large files' bytes are copied by a helper thread while the
walk goes on (two CPUs busy instead of one); what is copied and left out is exactly what a
one-thread copy would decide (see ``_Walker._fits``), only an error from copying a large
file's bytes may be listed after errors of entries the walk met later. Not guaranteed:
ownership, hard links, xattrs/ACLs, an atomic snapshot of a tree that changes while copied, and
the path components above ``src`` (only ``src`` itself is opened without following).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Final

from sandbox.contracts.errors import PrepareError
from sandbox.contracts.layout import TEST_RUN_PREFIX
from sandbox.contracts.reports import MAX_LISTED, CopyReport, LeftOut, SymlinkEntry
from sandbox.hostfs.fdcopy import copy_fd

__all__ = ["DEFAULT_CAP_BYTES", "CopyTreeError", "copy_execution_tree", "newest_real_run"]

DEFAULT_CAP_BYTES: Final = 512 * 1024**2
DEFAULT_MAX_ENTRIES: Final = 200_000

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

# Files at least this large have their bytes copied by the helper thread (below it, handing
# a file over costs more than copying it); at most this many such files are in flight (each
# holds three fds), beyond that the walk copies the next one itself.
_HELPER_MIN_BYTES: Final = 256 * 1024
_MAX_IN_FLIGHT: Final = 8


class CopyTreeError(PrepareError):
    """The destination of a tree copy is unusable (the source's problems are only reported)."""


def _display(parts: tuple[str, ...]) -> str:
    """A JSON-safe posix path for the report (undecodable bytes become backslash escapes)."""
    rel = "/".join(parts) if parts else "."
    return rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class _DirFds:
    """Directories under one root opened one component at a time, never following, with
    the most recent ones kept open: a folder's parent is usually still open, so a chain
    thousands of folders deep costs one open per folder, not one per component."""

    KEEP: Final = 64

    def __init__(self, root_fd: int) -> None:
        self._open: OrderedDict[tuple[str, ...], int] = OrderedDict({(): root_fd})

    def open(self, parts: tuple[str, ...]) -> int:
        """A new fd (the caller closes it) for the directory at ``parts``."""
        depth = len(parts)
        while parts[:depth] not in self._open:
            depth -= 1
        fd = self._open[parts[:depth]]
        for i in range(depth, len(parts)):
            fd = os.open(parts[i], _DIR_FLAGS, dir_fd=fd)
            self._keep(parts[: i + 1], fd)
        self._open.move_to_end(parts)
        return os.dup(fd)

    def _keep(self, parts: tuple[str, ...], fd: int) -> None:
        self._open[parts] = fd
        while len(self._open) > self.KEEP:
            key = next(k for k in self._open if k)  # the root fd is the caller's
            os.close(self._open.pop(key))

    def close(self) -> None:
        for key, fd in self._open.items():
            if key:
                os.close(fd)
        self._open.clear()


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "char device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "unknown type"


def _cost(st: os.stat_result) -> int:
    """What copying a file costs: its data, not its holes (never more than its size)."""
    return min(st.st_size, st.st_blocks * 512)


def _why(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "replaced by a symlink or not a directory while copying (not followed)"
    return exc.strerror or str(exc)


class _Walker:
    """One copy: state shared by the per-directory steps."""

    def __init__(self, src_root: int, dst_root: int, report: CopyReport, max_entries: int) -> None:
        self.src = _DirFds(src_root)
        self.dst = _DirFds(dst_root)
        self.r = report
        self.entries_left = max_entries
        # (relative parts, mode, atime_ns, mtime_ns) of created dirs, applied after the walk.
        self.dir_meta: list[tuple[tuple[str, ...], int, int, int]] = []
        # The helper thread (made at the first large file, only with a second CPU), the
        # files it is copying in the order they were handed over (with the most each can
        # add: its size), and the sum of those.
        self.helper: ThreadPoolExecutor | None = None
        self.use_helper = len(os.sched_getaffinity(0)) > 1
        self.in_flight: deque[tuple[Future[int], tuple[str, ...], int]] = deque()
        self.in_flight_bytes = 0

    def run(self) -> None:
        try:
            self._run()
        finally:
            try:
                self._drain()
            finally:
                if self.helper is not None:
                    self.helper.shutdown(wait=True)
                self.src.close()
                self.dst.close()

    def _run(self) -> None:
        queue: deque[tuple[str, ...]] = deque([()])
        while queue:
            rel = queue.popleft()
            try:
                sfd = self.src.open(rel)
            except OSError as exc:
                self.r.note_error(f"{_display(rel)}: cannot open directory: {_why(exc)}")
                continue
            try:
                dfd = self.dst.open(rel)
            except OSError as exc:
                os.close(sfd)
                raise CopyTreeError(f"cannot open destination {_display(rel)}: {exc}") from exc
            try:
                queue.extend(self._copy_dir(sfd, dfd, rel))
            finally:
                os.close(sfd)
                os.close(dfd)
            self._collect(block=False)
        self._drain()  # every file's bytes are in before its folder's times are set
        self._apply_dir_meta()

    def _copy_dir(self, sfd: int, dfd: int, rel: tuple[str, ...]) -> list[tuple[str, ...]]:
        try:
            names: list[str] = []
            with os.scandir(sfd) as it:
                for entry in it:
                    if len(names) >= self.entries_left:
                        self.r.entries_capped = True
                        break
                    names.append(entry.name)
            names.sort(key=os.fsencode)
        except OSError as exc:
            self.r.note_error(f"{_display(rel)}: cannot list directory: {_why(exc)}")
            return []
        self.entries_left -= len(names)
        subdirs: list[tuple[str, ...]] = []
        for name in names:
            parts = (*rel, name)
            try:
                st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            except OSError as exc:
                self.r.note_error(f"{_display(parts)}: {_why(exc)}")
                continue
            mode = st.st_mode
            try:
                if stat.S_ISDIR(mode):
                    os.mkdir(name, 0o700, dir_fd=dfd)
                    self.r.dirs_created += 1
                    self.dir_meta.append((parts, mode, st.st_atime_ns, st.st_mtime_ns))
                    subdirs.append(parts)
                elif stat.S_ISLNK(mode):
                    self._copy_link(sfd, dfd, name, parts, st)
                elif stat.S_ISREG(mode):
                    self._copy_file(sfd, dfd, name, parts, _cost(st))
                else:
                    self.r.skipped_special_count += 1
                    if len(self.r.skipped_special) < MAX_LISTED:
                        self.r.skipped_special.append(f"{_display(parts)} ({_kind(mode)})")
            except OSError as exc:
                self.r.note_error(f"{_display(parts)}: {_why(exc)}")
        return subdirs

    def _copy_link(
        self, sfd: int, dfd: int, name: str, parts: tuple[str, ...], st: os.stat_result
    ) -> None:
        target = os.readlink(name, dir_fd=sfd)
        os.symlink(target, name, dir_fd=dfd)
        with contextlib.suppress(OSError):  # link times are cosmetic; some file systems refuse
            os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dfd, follow_symlinks=False)
        shown = target.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        self.r.symlinks_count += 1
        if len(self.r.symlinks) < MAX_LISTED:
            self.r.symlinks.append(SymlinkEntry(path=_display(parts), target=shown[:1000]))

    def _fits(self, size: int) -> bool:
        """Whether ``size`` more bytes fit under the cap, decided as a one-thread copy would:
        on the bytes copied so far. A file in flight adds at most its size, so when the
        cap holds even with every one of them at its size it holds for sure; otherwise
        the files in flight are waited for and the exact sum decides."""
        if self.r.bytes_copied + self.in_flight_bytes + size <= self.r.cap_bytes:
            return True
        self._drain()
        return self.r.bytes_copied + size <= self.r.cap_bytes

    def _collect(self, *, block: bool) -> None:
        """Record the helper's finished files, oldest first (all of them if ``block``)."""
        while self.in_flight and (block or self.in_flight[0][0].done()):
            future, parts, reserved = self.in_flight.popleft()
            self.in_flight_bytes -= reserved
            try:
                n = future.result()
            except OSError as exc:
                self.r.note_error(f"{_display(parts)}: {_why(exc)}")
                continue
            self.r.files_copied += 1
            self.r.bytes_copied += n

    def _drain(self) -> None:
        self._collect(block=True)

    def _leave_out(self, parts: tuple[str, ...], size: int) -> bool:
        if self._fits(size):
            return False
        self.r.left_out_count += 1
        if len(self.r.left_out) < MAX_LISTED:
            self.r.left_out.append(LeftOut(path=_display(parts), size=size, reason="cap"))
        return True

    def _copy_file(self, sfd: int, dfd: int, name: str, parts: tuple[str, ...], size: int) -> None:
        if self._leave_out(parts, size):
            return
        src = os.open(name, _READ_FLAGS, dir_fd=sfd)
        try:
            st = os.fstat(src)
            if not stat.S_ISREG(st.st_mode):
                self.r.note_error(f"{_display(parts)}: changed type while copying; skipped")
                return
            if self._leave_out(parts, _cost(st)):  # grew since it was listed
                return
            self._collect(block=False)  # frees the slots of files the helper has done
            dst = os.open(name, _CREATE_FLAGS, 0o600, dir_fd=dfd)
            if (
                self.use_helper
                and st.st_size >= _HELPER_MIN_BYTES
                and len(self.in_flight) < _MAX_IN_FLIGHT
            ):
                self._hand_over(src, dst, dfd, name, parts, st)
                src = -1  # the helper's now
                return
            n = _copy_file_data(src, dst, dfd, name, st)
        finally:
            if src >= 0:
                os.close(src)
        self.r.files_copied += 1
        self.r.bytes_copied += n

    def _hand_over(
        self, src: int, dst: int, dfd: int, name: str, parts: tuple[str, ...], st: os.stat_result
    ) -> None:
        """Let the helper copy the file's bytes: once handed over, it closes ``src`` and
        ``dst``; if it cannot be handed over, ``dst`` is closed and removed here and
        ``src`` stays the caller's."""
        try:
            dir_fd = os.dup(dfd)  # to remove a half-copied file after the folder's fd is gone
        except OSError:
            os.close(dst)
            os.unlink(name, dir_fd=dfd)
            raise
        try:
            if self.helper is None:
                self.helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copytree")
            future = self.helper.submit(_helper_copy, src, dst, dir_fd, name, st)
        except BaseException:
            os.close(dst)
            os.unlink(name, dir_fd=dir_fd)
            os.close(dir_fd)
            raise
        self.in_flight.append((future, parts, st.st_size))
        self.in_flight_bytes += st.st_size

    def _apply_dir_meta(self) -> None:
        # Deepest first: a parent's restrictive mode must not block reaching its children, and
        # setting a child's times must not disturb the parent's mtime afterwards.
        for parts, mode, atime, mtime in reversed(self.dir_meta):
            try:
                fd = self.dst.open(parts)
            except OSError as exc:
                self.r.note_error(f"{_display(parts)}: cannot set mode/mtime: {exc.strerror}")
                continue
            try:
                os.fchmod(fd, stat.S_IMODE(mode) & 0o777)
                os.utime(fd, ns=(atime, mtime))
            except OSError as exc:
                self.r.note_error(f"{_display(parts)}: cannot set mode/mtime: {exc.strerror}")
            finally:
                os.close(fd)


def _copy_file_data(src: int, dst: int, dfd: int, name: str, st: os.stat_result) -> int:
    """Copy the bytes, mode and times of an open file into the new ``dst`` (closed here);
    on failure the half-copied file is removed and the error raised."""
    try:
        n = copy_fd(src, dst, limit=st.st_size, src_size=st.st_size)
        os.fchmod(dst, stat.S_IMODE(st.st_mode) & 0o777)
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    except OSError:
        os.close(dst)
        os.unlink(name, dir_fd=dfd)
        raise
    os.close(dst)
    return n


def _helper_copy(src: int, dst: int, dir_fd: int, name: str, st: os.stat_result) -> int:
    """The helper thread's part: ``_copy_file_data``, then every fd it was given closed."""
    try:
        return _copy_file_data(src, dst, dir_fd, name, st)
    finally:
        os.close(src)
        os.close(dir_fd)


# Order (deterministic; it decides what the cap leaves out): breadth-first by depth, so every
# file of depth N is considered before any file of depth N+1; within one directory, by name in
# byte order. A file that would push the total over the cap is left out and the walk goes on,
# so smaller files after it still fill the cap.


def copy_execution_tree(
    src: Path,
    dst: Path,
    *,
    cap_bytes: int = DEFAULT_CAP_BYTES,
    max_entries: int = DEFAULT_MAX_ENTRIES,
) -> CopyReport:
    """Copy the tree at ``src`` into the existing empty directory ``dst`` (see module doc).

    A missing ``src`` gives ``source_missing=True`` and copies nothing; a ``src`` that is a
    symlink or not a directory is reported as an error, not followed. Raises
    :class:`CopyTreeError` only when ``dst`` itself cannot be used. At most
    ``max_entries`` entries are looked at (``entries_capped`` says when more were there).
    """
    if cap_bytes < 0:
        raise ValueError("cap_bytes must be >= 0")
    report = CopyReport(source=str(src), dest=str(dst), cap_bytes=cap_bytes)
    try:
        src_root = os.open(src, _DIR_FLAGS)
    except FileNotFoundError:
        report.source_missing = True
        return report
    except OSError as exc:
        report.note_error(f".: cannot open source directory: {_why(exc)}")
        return report
    try:
        try:
            dst_root = os.open(dst, _DIR_FLAGS)
        except OSError as exc:
            raise CopyTreeError(f"cannot open copy destination {dst}: {exc.strerror}") from exc
        try:
            _Walker(src_root, dst_root, report, max_entries).run()
        finally:
            os.close(dst_root)
    finally:
        os.close(src_root)
    return report


def newest_real_run(workflow_dir: Path, group: str) -> Path | None:
    """The newest ``runs/<run-id>/<group>/execution`` directory of a real (non ``test-``) run.

    Newest by the run directory's mtime, ties broken by run-id (larger name wins). Run
    directories, group folders and ``execution`` entries that are symlinks are ignored, never
    followed. Returns None when there is no such run.
    """
    if not group or group in (".", "..") or "/" in group or "\x00" in group:
        raise ValueError(f"invalid group name: {group!r}")
    try:
        runs_fd = os.open(workflow_dir / "runs", _DIR_FLAGS)
    except OSError:
        return None
    best: tuple[int, bytes, str] | None = None
    try:
        with os.scandir(runs_fd) as it:
            names = [e.name for e in it]
        for name in names:
            if name.startswith(TEST_RUN_PREFIX):
                continue
            try:
                run_fd = os.open(name, _DIR_FLAGS, dir_fd=runs_fd)
            except OSError:
                continue  # not a directory, or a symlink: ignored
            try:
                run_mtime = os.fstat(run_fd).st_mtime_ns
                group_fd = os.open(group, _DIR_FLAGS, dir_fd=run_fd)
                try:
                    ex = os.stat("execution", dir_fd=group_fd, follow_symlinks=False)
                finally:
                    os.close(group_fd)
            except OSError:
                continue
            finally:
                os.close(run_fd)
            if not stat.S_ISDIR(ex.st_mode):
                continue
            key = (run_mtime, os.fsencode(name), name)
            if best is None or key[:2] > best[:2]:
                best = key
    finally:
        os.close(runs_fd)
    if best is None:
        return None
    return workflow_dir / "runs" / best[2] / group / "execution"
