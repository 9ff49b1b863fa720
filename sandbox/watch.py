"""What the step did to its group folder: created, changed, deleted files.

Two sources: an lstat snapshot before and after the run (the ground truth,
walked with `os.fwalk` on directory fds so a symlink the step planted is
recorded as a link and never followed), and a watchdog observer during the
run, which catches files that were created and removed again (`transient`).
It does not attribute a change to a process, and caps how many paths it lists.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from sandbox.record import FileChanges

MAX_LISTED = 1000
MAX_ENTRIES = 200_000


@dataclass(frozen=True)
class Entry:
    kind: str
    size: int
    mtime_ns: int
    inode: int
    link_target: str | None = None


Snapshot = dict[str, Entry]


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "special"


def snapshot(root: Path) -> Snapshot:
    """Every entry below `root` by relative posix path; never follows a link."""
    result: Snapshot = {}
    if not root.is_dir() or root.is_symlink():
        return result
    for dirpath, dirnames, filenames, dirfd in os.fwalk(root, follow_symlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        for name in [*dirnames, *filenames]:
            if len(result) >= MAX_ENTRIES:
                return result
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except OSError:
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            target = None
            if stat.S_ISLNK(st.st_mode):
                try:
                    target = os.readlink(name, dir_fd=dirfd)
                except OSError:
                    target = "?"
            result[rel] = Entry(_kind(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ino, target)
    return result


def compare(before: Snapshot, after: Snapshot, seen_created: set[str]) -> FileChanges:
    """Directories count only when created or deleted; their mtime churn is noise."""
    created = sorted(p for p in after.keys() - before.keys())
    deleted = sorted(p for p in before.keys() - after.keys())
    changed = sorted(
        p
        for p in after.keys() & before.keys()
        if after[p] != before[p] and not (after[p].kind == before[p].kind == "dir")
    )
    transient = sorted(p for p in seen_created - after.keys() - before.keys())
    lists = [created, changed, deleted, transient]
    truncated = any(len(x) > MAX_LISTED for x in lists)
    return FileChanges(
        created=created[:MAX_LISTED],
        changed=changed[:MAX_LISTED],
        deleted=deleted[:MAX_LISTED],
        transient=transient[:MAX_LISTED],
        truncated=truncated,
    )


class _Collector(FileSystemEventHandler):
    def __init__(self, root: Path) -> None:
        self._root = str(root)
        self._lock = threading.Lock()
        self.created: set[str] = set()

    def on_created(self, event: FileSystemEvent) -> None:
        path = os.fsdecode(event.src_path)
        rel = os.path.relpath(path, self._root)
        if rel.startswith(".."):
            return
        with self._lock:
            if len(self.created) < MAX_ENTRIES:
                self.created.add(rel)

    def on_moved(self, event: FileSystemEvent) -> None:
        dest = getattr(event, "dest_path", None)
        if dest:
            rel = os.path.relpath(os.fsdecode(dest), self._root)
            with self._lock:
                self.created.add(rel)


class FolderWatch:
    """Start before the step, stop after it; `changes()` gives the verdict."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._before: Snapshot = {}
        self._collector = _Collector(root)
        self._observer: Observer | None = None  # type: ignore[valid-type]

    def start(self) -> None:
        self._before = snapshot(self._root)
        observer = Observer()
        observer.schedule(self._collector, str(self._root), recursive=True)
        observer.daemon = True
        observer.start()
        self._observer = observer

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=10)
            self._observer = None

    def changes(self) -> FileChanges:
        self.stop()
        return compare(self._before, snapshot(self._root), self._collector.created)
