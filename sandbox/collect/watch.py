"""What the step did to its group folder: created, changed, deleted files.

An lstat snapshot of the folder before the step starts and another after it stopped,
compared. Both are fd-based walks (`sandbox.hostfs.fdtree`): a link the step planted is
recorded as a link and never followed, a folder it swapped for a link is not entered,
a chain of any depth is walked without recursion, and at most `MAX_ENTRIES` entries
are looked at (the step's disk caps its inodes anyway). Nothing watches during the
run, so the step cannot spend the host's inotify watches; the price is that a file
created and removed again during the run is not seen. Paths are relative to the group
folder, as the step sees them; it does not attribute a change to a process, and caps
how many paths it lists.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from sandbox.contracts.record import FileChanges
from sandbox.hostfs import fdtree

MAX_LISTED = 1000
MAX_ENTRIES = 200_000


@dataclass(frozen=True)
class Entry:
    kind: str
    size: int
    mtime_ns: int
    inode: int
    link_target: str | None = None


@dataclass
class Snapshot:
    entries: dict[str, Entry]
    capped: bool = False


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "special"


def snapshot(root: Path, max_entries: int = MAX_ENTRIES) -> Snapshot:
    """Every entry below `root` by relative posix path; never follows a link."""
    result = Snapshot({})
    try:
        root_fd = fdtree.open_root(root)
    except OSError:
        return result
    stats = fdtree.WalkStats()
    try:
        for item in fdtree.walk(root_fd, max_entries=max_entries, stats=stats):
            st = item.st
            target = None
            if stat.S_ISLNK(st.st_mode):
                try:
                    target = os.readlink(item.name, dir_fd=item.dir_fd)
                except OSError:
                    target = "?"
            rel = fdtree.display(item.parts)
            result.entries[rel] = Entry(
                _kind(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino, target
            )
    except OSError:
        result.capped = True
    finally:
        os.close(root_fd)
    result.capped |= stats.capped
    return result


def compare(before: Snapshot, after: Snapshot) -> FileChanges:
    """Directories count only when created or deleted; their mtime churn is noise."""
    b, a = before.entries, after.entries
    created = sorted(p for p in a.keys() - b.keys())
    deleted = sorted(p for p in b.keys() - a.keys())
    changed = sorted(
        p for p in a.keys() & b.keys() if a[p] != b[p] and not (a[p].kind == b[p].kind == "dir")
    )
    lists = [created, changed, deleted]
    truncated = any(len(x) > MAX_LISTED for x in lists) or before.capped or after.capped
    return FileChanges(
        created=created[:MAX_LISTED],
        changed=changed[:MAX_LISTED],
        deleted=deleted[:MAX_LISTED],
        truncated=truncated,
    )


class FolderWatch:
    """`start()` before the step, `changes()` after it stopped."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._before = Snapshot({})

    def start(self) -> None:
        self._before = snapshot(self._root)

    def changes(self) -> FileChanges:
        return compare(self._before, snapshot(self._root))
