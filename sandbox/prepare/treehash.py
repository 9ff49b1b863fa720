"""The workflow folder's files as hashed parts: every file, by content, links by their target.

Guarantees: every entry below the root that `is_data` does not exclude is hashed whole
(no entry cap short of `MAX_ENTRIES`, no byte cap short of `MAX_BYTES`); what could not
be hashed (an unreadable entry, a fifo, socket or device, a folder the walk could not
enter, a cap reached) is named in `TreeHash.not_covered`, never dropped silently. The
walk and every link resolution work on directory fds with `O_NOFOLLOW` (`sandbox.hostfs
.fdtree`): no path is ever opened through a link, and nothing outside the root is opened.

A link is resolved as the step sees it (the folder is `/workflow` in its containers),
component by component inside the root: to a file inside, it is hashed as that file's
content; to a folder inside, as that folder (whose files the walk hashes anyway); a link
that leaves the folder (an absolute path elsewhere, or `..` above it) is hashed as its
text, like a path written in the code (what it names is the image's or the step's input);
a dangling link or a loop is hashed as such. None of these makes the hash incomplete:
each is a fixed fact of the folder that changes the hash when it changes.

Listing: the record keeps one part per file up to `MAX_LISTED` parts; a larger tree is
listed by folder (the deepest level that fits), each folder part the hash of everything
below it, so a huge vendored tree is covered whole and the record stays small.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import posixpath
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from sandbox.contracts.layout import C_WORKFLOW
from sandbox.hostfs import fdtree

MAX_ENTRIES: Final = 2_000_000
MAX_BYTES: Final = 16 * 1024**3
MAX_LISTED: Final = 5_000
MAX_LINK_HOPS: Final = 40
MAX_REASONS: Final = 20
_FILE_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

Parts = tuple[str, ...]


@dataclass
class TreeHash:
    """`parts`: relative path -> hash; `not_covered`: what the hash could not include."""

    parts: dict[str, str] = field(default_factory=dict)
    not_covered: list[str] = field(default_factory=list)
    bytes_read: int = 0

    def miss(self, what: str) -> None:
        self.not_covered.append(what)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a fifo"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return f"a special file ({stat.S_IFMT(mode):o})"


def _hash_file(dir_fd: int, name: str, st: os.stat_result, out: TreeHash, label: str) -> str:
    """A regular file's content (+x when executable); anything else is named as missed."""
    if not stat.S_ISREG(st.st_mode):
        out.miss(f"{label}: {_kind(st.st_mode)} (its content cannot be hashed)")
        return "special:" + _kind(st.st_mode)
    if out.bytes_read + st.st_size > MAX_BYTES:
        out.miss(f"{label}: past the {MAX_BYTES // 1024**3} GiB the hash reads (declare data)")
        return "not read: too large"
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        out.miss(f"{label}: unreadable ({exc.strerror})")
        return f"unreadable:{exc.errno}"
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
            out.miss(f"{label}: replaced while hashed")
            return "unreadable:changed"
        digest = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
            out.bytes_read += len(chunk)
    except OSError as exc:
        out.miss(f"{label}: unreadable ({exc.strerror})")
        return f"unreadable:{exc.errno}"
    finally:
        os.close(fd)
    return digest.hexdigest() + ("+x" if st.st_mode & 0o111 else "")


def _open_dir(root_fd: int, parts: Parts) -> int:
    """The folder at `parts` below the root, each component opened without following."""
    fd = os.open(".", fdtree.DIR_FLAGS, dir_fd=root_fd)
    for name in parts:
        try:
            sub = os.open(name, fdtree.DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = sub
    return fd


def _in_root(target: str) -> list[str] | None:
    """An absolute link target as components below the root (the step's `/workflow`),
    None when it names something outside it."""
    norm = posixpath.normpath(target)
    if norm == C_WORKFLOW:
        return []
    if norm.startswith(C_WORKFLOW + "/"):
        return norm[len(C_WORKFLOW) + 1 :].split("/")
    return None


def link_part(root_fd: int, parent: Parts, text: str, out: TreeHash, label: str) -> str:
    """The hash of a link at `parent/<name>` whose target is `text`, resolved inside the
    root as the step would resolve it (see the module docstring)."""
    if text.startswith("/"):
        inside = _in_root(text)
        if inside is None:
            return f"link out of the folder:{text}"
        pending, cur = inside, []
    else:
        pending, cur = text.split("/"), list(parent)
    hops = 1
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            if not cur:
                return f"link out of the folder:{text}"
            cur.pop()
            continue
        try:
            dir_fd = _open_dir(root_fd, tuple(cur))
        except OSError:
            return f"link dangling:{text}"
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > MAX_LINK_HOPS:
                    return f"link loop:{text}"
                more = os.readlink(name, dir_fd=dir_fd)
                if more.startswith("/"):
                    inside = _in_root(more)
                    if inside is None:
                        return f"link out of the folder:{text} -> {more}"
                    pending, cur = inside + pending, []
                else:
                    pending = more.split("/") + pending
                continue
            if stat.S_ISDIR(st.st_mode):
                cur.append(name)
                continue
            if pending and any(p not in ("", ".") for p in pending):
                return f"link dangling:{text}"
            return "link to file:" + _hash_file(dir_fd, name, st, out, label)
        except FileNotFoundError:
            return f"link dangling:{text}"
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ENOENT):
                return f"link dangling:{text}"
            out.miss(f"{label}: its link target is unreadable ({exc.strerror})")
            return f"unreadable:{exc.errno}"
        finally:
            os.close(dir_fd)
    return "link to folder:" + "/".join(cur)


def entry_part(root_fd: int, entry: fdtree.Entry, out: TreeHash) -> str | None:
    """One walked entry's hash; None for a folder (its files are its parts)."""
    label = fdtree.display(entry.parts)
    if stat.S_ISDIR(entry.st.st_mode):
        return None
    if stat.S_ISLNK(entry.st.st_mode):
        try:
            text = os.readlink(entry.name, dir_fd=entry.dir_fd)
        except OSError as exc:
            out.miss(f"{label}: unreadable link ({exc.strerror})")
            return f"unreadable:{exc.errno}"
        return link_part(root_fd, entry.parts[:-1], text, out, label)
    return _hash_file(entry.dir_fd, entry.name, entry.st, out, label)


def hash_tree(root: Path, is_data: Callable[[Parts], bool]) -> TreeHash:
    """Every entry below `root` except what `is_data` names (not entered), hashed."""
    out = TreeHash()
    files: dict[Parts, str] = {}
    try:
        root_fd = fdtree.open_root(root)
    except OSError as exc:
        out.miss(f"the workflow folder: unreadable ({exc.strerror})")
        return out
    stats = fdtree.WalkStats()
    try:
        empty: set[Parts] = set()
        for entry in fdtree.walk(
            root_fd,
            max_entries=MAX_ENTRIES,
            stats=stats,
            enter=lambda parts: not is_data(parts),
        ):
            if is_data(entry.parts):
                continue
            empty.discard(entry.parts[:-1])
            if entry.is_dir:
                empty.add(entry.parts)
            value = entry_part(root_fd, entry, out)
            if value is not None:
                files[entry.parts] = value
        for parts in empty:  # a folder with nothing in it is there all the same
            files[parts] = "empty folder"
    except OSError as exc:  # the tree changed under the walk: it covered no single state
        out.miss(f"the walk stopped: {exc}")
    finally:
        os.close(root_fd)
    out.not_covered.extend(stats.errors)
    if stats.capped:
        out.miss(f"more than {MAX_ENTRIES} entries (declare data)")
    out.parts = _listed(files)
    return out


def file_part(root: Path, rel: str, out: TreeHash) -> str:
    """One path below the root (a file the step names), resolved like a link to it."""
    try:
        root_fd = fdtree.open_root(root)
    except OSError as exc:
        out.miss(f"{rel}: the workflow folder is unreadable ({exc.strerror})")
        return f"unreadable:{exc.errno}"
    try:
        value = link_part(root_fd, (), rel, out, rel)
    finally:
        os.close(root_fd)
    return value.removeprefix("link to file:").replace("link dangling:", "missing:", 1)


def _listed(files: dict[Parts, str]) -> dict[str, str]:
    """One part per file when they fit in MAX_LISTED, else grouped by folder at the
    deepest level that fits (a group's hash covers every entry below it)."""
    if len(files) <= MAX_LISTED:
        return {fdtree.display(p): v for p, v in files.items()}
    depth = 0
    while True:
        keys = {p[: depth + 1] if len(p) > depth + 1 else p for p in files}
        if len(keys) > MAX_LISTED or depth > max(len(p) for p in files):
            break
        depth += 1
    depth = max(depth - 1, 0)
    groups: dict[Parts, list[tuple[str, str]]] = {}
    listed: dict[str, str] = {}
    for parts, value in sorted(files.items()):
        if len(parts) > depth + 1:
            groups.setdefault(parts[: depth + 1], []).append(("/".join(parts[depth + 1 :]), value))
        else:
            listed[fdtree.display(parts)] = value
    for folder, entries in groups.items():
        blob = json.dumps(entries, separators=(",", ":"), ensure_ascii=False)
        key = fdtree.display(folder) + "/"
        listed[key] = f"folder of {len(entries)}:" + _sha(blob.encode("utf-8", "surrogateescape"))
    return listed
