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

Changed means changed in content: a file is listed when its bytes, its type, its mode,
its mtime or its link target differ, so a step that rewrites a file in place with the
same size and sets its timestamps back is still seen. The first snapshot hashes every
regular file (what was copied in, at most the copy cap); the second hashes again only
the files whose (inode, size, mode, mtime, ctime) moved, and trusts the first hash for
the others. That trust rests on ctime, which on the step's disk cannot lie: the disk is
an ext4 made for the run with 256-byte inodes (nanosecond times, `sandbox.stepfs.disk`),
the kernel sets a file's ctime to the current time on every write and every metadata
change and no call lets a process set it (utimensat sets mtime/atime, and ctime to
now), the clock cannot be set without CAP_SYS_TIME (the step has no capability), and
the disk's device is not the step's to write. The step's first write comes after the
first snapshot and its container's start, so its ctime is later than any the snapshot
saw. Host-side reads open each file without following links, read only its data
extents (`SEEK_DATA`), and take its size from the host's own fstat, never from the
step; holes are part of the hash, so the same bytes with other holes count as changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sandbox.contracts.record import FileChanges
from sandbox.hostfs import fdtree
from sandbox.hostfs.fdcopy import data_extents

MAX_LISTED = 1000
MAX_ENTRIES = 200_000
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK: Final = 1024**2


@dataclass(frozen=True)
class Entry:
    kind: str
    size: int
    mode: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    link_target: str | None = None
    digest: str | None = None  # a regular file's content (None: could not be read)

    def same_inode_state(self, other: Entry) -> bool:
        """Nothing wrote it in between (ctime: see the module docstring)."""
        return (self.kind, self.inode, self.size, self.mode, self.mtime_ns, self.ctime_ns) == (
            other.kind,
            other.inode,
            other.size,
            other.mode,
            other.mtime_ns,
            other.ctime_ns,
        )

    def differs(self, other: Entry) -> bool:
        if self.kind != other.kind or self.mode != other.mode or self.mtime_ns != other.mtime_ns:
            return True
        if self.kind == "link":
            return self.link_target != other.link_target
        if self.kind == "file":
            return self.digest is None or self.digest != other.digest
        return self.size != other.size or self.inode != other.inode


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


def file_digest(dir_fd: int, name: str, st: os.stat_result) -> str | None:
    """The content hash of the regular file `name` that the walk saw as `st` (None if
    it is not that file any more or cannot be read): its data extents with their
    offsets, then its size, all from the host's own fstat of the file it opened."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        own = os.fstat(fd)
        if not stat.S_ISREG(own.st_mode) or own.st_ino != st.st_ino:
            return None
        h = hashlib.sha256()
        for offset, length in data_extents(fd, own.st_size):
            h.update(b"@" + offset.to_bytes(8, "big"))
            end = offset + length
            while offset < end:
                data = os.pread(fd, min(_CHUNK, end - offset), offset)
                if not data:
                    break
                h.update(data)
                offset += len(data)
        h.update(b"$" + own.st_size.to_bytes(8, "big"))
        return h.hexdigest()
    except OSError:
        return None
    finally:
        os.close(fd)


def snapshot(
    root: Path, max_entries: int = MAX_ENTRIES, *, since: Snapshot | None = None
) -> Snapshot:
    """Every entry below `root` by relative posix path; never follows a link. Regular
    files are hashed, except those `since` saw in the same state (same inode, size,
    mode, mtime and ctime), whose hash is taken from it."""
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
            entry = Entry(
                _kind(st.st_mode),
                st.st_size,
                stat.S_IMODE(st.st_mode),
                st.st_mtime_ns,
                st.st_ctime_ns,
                st.st_ino,
                target,
            )
            if entry.kind == "file":
                digest: str | None
                known = since.entries.get(rel) if since is not None else None
                if known is not None and known.digest is not None and known.same_inode_state(entry):
                    digest = known.digest
                else:
                    digest = file_digest(item.dir_fd, item.name, st)
                entry = dataclasses.replace(entry, digest=digest)
            result.entries[rel] = entry
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
        p
        for p in a.keys() & b.keys()
        if not (a[p].kind == b[p].kind == "dir") and a[p].differs(b[p])
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
        return compare(self._before, snapshot(self._root, since=self._before))
