"""Host-side walks and deletes of trees a step could have touched (its folders, its run).

The runner is root on a shared host, and everything below a step's folder is the
step's choice: links, odd names, chains thousands of folders deep, folders without
permissions. Every function here therefore works on directory fds, never follows a
link (each component is opened with ``O_NOFOLLOW``; a folder swapped for a link between
listing and opening is refused, not entered), is iterative (a chain of any depth costs
a few fds and no Python stack: it climbs back with ``..`` and checks the device and
inode it expects), and caps the entries it visits. Names are reported relative to the
root, as the step itself could see them; no path outside the root is ever opened.

Limits: a walk of a tree that changes while it is walked is a snapshot of no single
moment (the callers walk folders the step can no longer write); entries past the cap
are not visited (the caller is told).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_DIR_FLAGS: Final = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
DEFAULT_MAX_ENTRIES: Final = 200_000


class TreeChanged(OSError):
    """A folder was replaced while walked (``..`` led somewhere else): the walk stops."""


@dataclass
class Entry:
    """One entry, valid only until the walk goes on: ``dir_fd`` is its folder's fd."""

    parts: tuple[str, ...]
    st: os.stat_result
    dir_fd: int

    @property
    def name(self) -> str:
        return self.parts[-1]

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.st.st_mode)


@dataclass
class WalkStats:
    """What a walk could not do: entries past the cap, folders it could not open."""

    visited: int = 0
    capped: bool = False
    errors: list[str] = field(default_factory=list)

    def error(self, parts: tuple[str, ...], what: str) -> None:
        if len(self.errors) < 100:
            self.errors.append(f"{display(parts)}: {what}")


def display(parts: tuple[str, ...]) -> str:
    """A JSON-safe posix path (undecodable bytes become backslash escapes)."""
    rel = "/".join(parts) if parts else "."
    return rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _names(fd: int, budget: int) -> tuple[list[str], bool]:
    """The folder's names in byte order, at most ``budget`` of them (True: more were left)."""
    names: list[str] = []
    more = False
    with os.scandir(fd) as it:
        for item in it:
            if len(names) >= budget:
                more = True
                break
            names.append(item.name)
    names.sort(key=os.fsencode)
    return names, more


def _same(st: os.stat_result, dev: int, ino: int) -> bool:
    return st.st_dev == dev and st.st_ino == ino


@dataclass
class _Frame:
    names: list[str]
    index: int
    parts: tuple[str, ...]
    dev: int
    ino: int


def walk(
    root_fd: int,
    *,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    stats: WalkStats | None = None,
    on_leave: Callable[[tuple[str, ...], int], None] | None = None,
    enter: Callable[[tuple[str, ...]], bool] | None = None,
) -> Iterator[Entry]:
    """Every entry below ``root_fd`` (not the root), depth first, names in byte order.

    A folder is entered right after it is yielded, unless ``enter(parts)`` says not to,
    or it cannot be opened without following a link (the error is noted in ``stats``).
    ``on_leave(parts, parent_fd)`` is called for each folder once its last entry was
    yielded, with its parent's fd (so a caller can act after a folder's contents, e.g.
    delete it)."""
    stats = stats if stats is not None else WalkStats()
    root_st = os.fstat(root_fd)
    cur = os.open(".", DIR_FLAGS, dir_fd=root_fd)
    try:
        names, more = _names(cur, max_entries)
        stats.capped |= more
        stack = [_Frame(names, 0, (), root_st.st_dev, root_st.st_ino)]
        while stack:
            frame = stack[-1]
            if frame.index >= len(frame.names):
                stack.pop()
                if stack:
                    up = os.open("..", DIR_FLAGS, dir_fd=cur)
                    os.close(cur)
                    cur = up
                    if not _same(os.fstat(cur), stack[-1].dev, stack[-1].ino):
                        raise TreeChanged(
                            errno.ESTALE, f"{display(frame.parts)} moved while walked"
                        )
                    if on_leave is not None:
                        on_leave(frame.parts, cur)
                continue
            name = frame.names[frame.index]
            frame.index += 1
            parts = (*frame.parts, name)
            try:
                st = os.stat(name, dir_fd=cur, follow_symlinks=False)
            except OSError as exc:
                stats.error(parts, exc.strerror or str(exc))
                continue
            if stats.visited >= max_entries:
                stats.capped = True
                return
            stats.visited += 1
            yield Entry(parts, st, cur)
            if not stat.S_ISDIR(st.st_mode) or (enter is not None and not enter(parts)):
                continue
            try:
                sub = os.open(name, DIR_FLAGS, dir_fd=cur)
            except OSError as exc:
                stats.error(parts, _why(exc))
                continue
            if not _same(os.fstat(sub), st.st_dev, st.st_ino):
                os.close(sub)
                stats.error(parts, "replaced while walked (not entered)")
                continue
            try:
                names, more = _names(sub, max(0, max_entries - stats.visited))
            except OSError as exc:
                os.close(sub)
                stats.error(parts, exc.strerror or str(exc))
                continue
            stats.capped |= more
            os.close(cur)
            cur = sub
            stack.append(_Frame(names, 0, parts, st.st_dev, st.st_ino))
    finally:
        os.close(cur)


def _why(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a symlink or not a directory (not followed)"
    return exc.strerror or str(exc)


def open_root(path: Path | str) -> int:
    """The folder at ``path`` as an fd; its last component is never followed."""
    return os.open(path, DIR_FLAGS)


def chown_tree(root: Path, uid: int, gid: int, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
    """Give every entry below ``root`` (and ``root``) to ``uid:gid``; links stay links."""
    fd = open_root(root)
    try:
        os.fchown(fd, uid, gid)
        for entry in walk(fd, max_entries=max_entries):
            os.chown(entry.name, uid, gid, dir_fd=entry.dir_fd, follow_symlinks=False)
    finally:
        os.close(fd)


def _make_enterable(dir_fd: int, name: str) -> None:
    """Let the runner list and empty a folder whose mode shuts it out (a non-root runner)."""
    with contextlib.suppress(OSError):
        pfd = os.open(name, _PATH_DIR_FLAGS, dir_fd=dir_fd)
        try:
            os.chmod(f"/proc/self/fd/{pfd}", 0o700)
        finally:
            os.close(pfd)


def _empty(root_fd: int, stats: WalkStats) -> None:
    """Delete everything below ``root_fd``: files as they come, folders on the way up."""
    if os.geteuid() != 0:
        # Folders without rwx for us: open them up first (a walk cannot enter them).
        for entry in walk(root_fd, max_entries=2**62, stats=WalkStats()):
            if entry.is_dir and (entry.st.st_mode & 0o700) != 0o700:
                _make_enterable(entry.dir_fd, entry.name)

    def rmdir(parts: tuple[str, ...], parent_fd: int) -> None:
        try:
            os.rmdir(parts[-1], dir_fd=parent_fd)
        except OSError as exc:
            stats.error(parts, exc.strerror or str(exc))

    for entry in walk(root_fd, max_entries=2**62, stats=stats, on_leave=rmdir):
        if entry.is_dir:
            continue
        try:
            os.unlink(entry.name, dir_fd=entry.dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            stats.error(entry.parts, exc.strerror or str(exc))


def remove_tree(path: Path) -> list[str]:
    """Delete ``path`` and everything below it, whatever the step made of it.

    Any depth, any names, folders without permissions (opened up when the runner is not
    root), links deleted as links. A link or a file at ``path`` itself is unlinked.
    Returns what could not be deleted (empty when all is gone); a missing path is fine."""
    stats = WalkStats()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return []
    parent = os.open(path.parent, DIR_FLAGS)
    try:
        if os.geteuid() != 0 and (st.st_mode & 0o700) != 0o700:
            _make_enterable(parent, path.name)
        fd = os.open(path.name, DIR_FLAGS, dir_fd=parent)
        try:
            if not _same(os.fstat(fd), st.st_dev, st.st_ino):
                return [f"{path}: replaced while deleted"]
            _empty(fd, stats)
        finally:
            os.close(fd)
        try:
            os.rmdir(path.name, dir_fd=parent)
        except OSError as exc:
            stats.errors.append(f"{path}: {exc.strerror}")
    finally:
        os.close(parent)
    return stats.errors
