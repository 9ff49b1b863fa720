"""The file tools (read, write, edit, list, search), rooted at the group folder.

Every path goes through `pathsafety.check_tool_path` and must still be inside the
root after resolving links; writes never follow a final link (`O_NOFOLLOW`).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import stat
import time
from collections.abc import Iterator
from typing import Any, Final, cast

from .pathsafety import check_tool_path, normalize_tool_path
from .results import ToolError, int_arg, os_reason, str_arg, tool_result
from .toolargs import (
    SEARCH_DEADLINE_S,
)

READ_DEFAULT_LIMIT: Final = 2000


READ_MAX_BYTES: Final = 256 * 1024


EDIT_MAX_BYTES: Final = 16 * 1024 * 1024


LIST_MAX_ENTRIES: Final = 1000


SEARCH_MAX_MATCHES: Final = 500


SEARCH_MAX_FILE_BYTES: Final = 2 * 1024 * 1024


SEARCH_MAX_LINE_CHARS: Final = 300


SEARCH_MAX_PATTERN_CHARS: Final = 1000


BINARY_SNIFF_BYTES: Final = 8192


def _inside(root: str, path: str) -> bool:
    return path == root or os.path.commonpath([root, path]) == root


def _open_regular(path: str, flags: int) -> int:
    """Open without following a final link and without blocking on a FIFO; regular files only."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ToolError(os_reason(exc)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ToolError("not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lines(handle: Any, keep: int) -> Iterator[str]:
    """Lines of a text file, each kept to ``keep`` characters (the rest is consumed)."""
    while True:
        line: str = handle.readline(keep)
        if not line:
            return
        rest = line
        while not rest.endswith("\n"):
            rest = handle.readline(keep)
            if not rest:
                break
        yield line


def _search_file(path: str, regex: re.Pattern[str]) -> Iterator[tuple[int, str]]:
    """(line number, shortened line) for each matching line; nothing for binary/big files."""
    try:
        fd = _open_regular(path, os.O_RDONLY)
    except ToolError:
        return
    with os.fdopen(fd, "rb") as handle:
        if os.fstat(handle.fileno()).st_size > SEARCH_MAX_FILE_BYTES:
            return
        raw = handle.read(SEARCH_MAX_FILE_BYTES + 1)
    if len(raw) > SEARCH_MAX_FILE_BYTES or b"\x00" in raw[:BINARY_SNIFF_BYTES]:
        return
    for line_no, line in enumerate(raw.decode("utf-8", "replace").split("\n"), start=1):
        if regex.search(line):
            line = line.rstrip("\r")
            if len(line) > SEARCH_MAX_LINE_CHARS:
                line = line[:SEARCH_MAX_LINE_CHARS] + "…"
            yield line_no, line


class FileTools:
    """The file tools; `root` is the resolved group folder."""

    root: str

    def _resolve(self, path: object) -> tuple[str, str]:
        """(normalized relative path, absolute joined path); refuses unsafe or escaping paths."""
        if path is None:
            raise ToolError("missing argument 'path'")
        reason = check_tool_path(path)
        if reason is not None:
            raise ToolError(f"refused: {reason}")
        rel = normalize_tool_path(cast(str, path))
        joined = self.root if rel == "." else os.path.join(self.root, rel)
        if not _inside(self.root, os.path.realpath(joined)):
            raise ToolError("refused: path leaves the group folder via a symlink")
        return rel, joined

    def _real(self, path: object) -> tuple[str, str]:
        """(normalized relative path, fully resolved absolute path inside ROOT)."""
        rel, joined = self._resolve(path)
        return rel, os.path.realpath(joined)

    def _write_target(self, path: object) -> tuple[str, str]:
        """(rel, absolute path whose folder is resolved and whose last part is not)."""
        rel, joined = self._resolve(path)
        if rel == ".":
            raise ToolError("is a folder, not a file")
        parent, name = os.path.split(joined)
        target = os.path.join(os.path.realpath(parent), name)
        if os.path.islink(target):
            raise ToolError(f"refused: {rel} is a symlink; will not write through it")
        return rel, target

    def _write_bytes(self, rel: str, target: str, data: bytes) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(target, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # the last part became a symlink
                raise ToolError(f"refused: {rel} is a symlink; will not write through it") from None
            raise ToolError(f"cannot write {rel}: {os_reason(exc)}") from None
        with os.fdopen(fd, "wb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ToolError(f"cannot write {rel}: not a regular file")
            os.set_blocking(handle.fileno(), True)
            handle.write(data)

    def read_file(self, args: dict[str, Any]) -> dict[str, Any]:
        rel, real = self._real(args.get("path"))
        offset = int_arg(args, "offset", 0, 0)
        limit = int_arg(args, "limit", READ_DEFAULT_LIMIT, 1)
        try:
            fd = _open_regular(real, os.O_RDONLY)
        except ToolError as exc:
            raise ToolError(f"cannot read {rel}: {exc}") from None
        out: list[str] = []
        size = 0
        cut = False
        next_offset: int | None = None
        with open(fd, encoding="utf-8", errors="replace", newline="\n") as handle:
            for line_no, line in enumerate(_lines(handle, READ_MAX_BYTES + 1)):
                if line_no < offset:
                    continue
                if line_no >= offset + limit:
                    next_offset = line_no
                    break
                encoded = line.encode("utf-8")
                if size + len(encoded) > READ_MAX_BYTES:
                    out.append(encoded[: READ_MAX_BYTES - size].decode("utf-8", "ignore"))
                    cut = True
                    next_offset = line_no + 1
                    break
                out.append(line)
                size += len(encoded)
        text = "".join(out)
        if cut:
            text += (
                f"\n[... cut at {READ_MAX_BYTES // 1024} KiB; the rest of this line is not shown;"
                f" continue with offset={next_offset}]"
            )
        elif not out and offset > 0:
            text = f"[no lines at offset {offset}: the file has fewer lines]"
        data = {
            "path": rel,
            "offset": offset,
            "lines": len(out),
            "truncated": cut,
            "next_offset": next_offset,
        }
        return tool_result(text, data)

    def write_file(self, args: dict[str, Any]) -> dict[str, Any]:
        content = str_arg(args, "content")
        rel, target = self._write_target(args.get("path"))
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        except OSError as exc:
            raise ToolError(f"cannot create the folder for {rel}: {os_reason(exc)}") from None
        # The folders now exist: check again that they resolve inside ROOT.
        rel, target = self._write_target(rel)
        data = content.encode("utf-8", errors="surrogateescape")
        self._write_bytes(rel, target, data)
        return tool_result(f"wrote {len(data)} bytes to {rel}", {"path": rel, "bytes": len(data)})

    def edit_file(self, args: dict[str, Any]) -> dict[str, Any]:
        old = str_arg(args, "old")
        new = str_arg(args, "new")
        if not old:
            raise ToolError("argument 'old' must not be empty")
        rel, target = self._write_target(args.get("path"))
        try:
            fd = _open_regular(target, os.O_RDONLY)
        except ToolError as exc:
            raise ToolError(f"cannot read {rel}: {exc}") from None
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(EDIT_MAX_BYTES + 1)
        if len(raw) > EDIT_MAX_BYTES:
            raise ToolError(f"{rel} is larger than {EDIT_MAX_BYTES // (1024 * 1024)} MiB")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(f"{rel} is not UTF-8 text") from None
        count = text.count(old)
        if count != 1:
            raise ToolError(
                f"old text occurs {count} times in {rel}; it must occur exactly once "
                "(include more surrounding text to make it unique)"
            )
        updated = text.replace(old, new, 1).encode("utf-8", errors="surrogateescape")
        self._write_bytes(rel, target, updated)
        return tool_result(f"edited {rel}", {"path": rel, "bytes": len(updated)})

    def list_dir(self, args: dict[str, Any]) -> dict[str, Any]:
        rel, real = self._real(args.get("path", "."))
        try:
            with os.scandir(real) as scan:
                found = sorted(scan, key=lambda e: e.name)
        except OSError as exc:
            raise ToolError(f"cannot list {rel}: {os_reason(exc)}") from None
        entries: list[str] = []
        for entry in found[:LIST_MAX_ENTRIES]:
            if entry.is_symlink():
                try:
                    entries.append(f"{entry.name} -> {os.readlink(entry.path)}")
                except OSError:
                    entries.append(f"{entry.name} -> ?")
            elif entry.is_dir(follow_symlinks=False):
                entries.append(entry.name + "/")
            else:
                entries.append(entry.name)
        truncated = len(found) > LIST_MAX_ENTRIES
        text = "\n".join(entries) if entries else f"({rel} is empty)"
        if truncated:
            text += f"\n[... {len(found) - LIST_MAX_ENTRIES} more entries not shown]"
        return tool_result(text, {"path": rel, "entries": entries, "truncated": truncated})

    def search_files(self, args: dict[str, Any]) -> dict[str, Any]:
        pattern = str_arg(args, "pattern")
        if len(pattern) > SEARCH_MAX_PATTERN_CHARS:
            raise ToolError(f"pattern is longer than {SEARCH_MAX_PATTERN_CHARS} characters")
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise ToolError(f"invalid regular expression: {exc}") from None
        glob = args.get("glob")
        if glob is not None and not isinstance(glob, str):
            raise ToolError("argument 'glob' must be a string")
        rel, real = self._real(args.get("path", "."))
        deadline = time.monotonic() + SEARCH_DEADLINE_S
        matches: list[dict[str, Any]] = []
        lines_out: list[str] = []
        notes: list[str] = []
        for file_path in self._walk(real):
            if time.monotonic() > deadline:
                notes.append(f"[search stopped after {SEARCH_DEADLINE_S:.0f} s]")
                break
            file_rel = os.path.relpath(file_path, self.root)
            if glob and not fnmatch.fnmatch(
                file_rel if "/" in glob else os.path.basename(file_rel), glob
            ):
                continue
            for line_no, line in _search_file(file_path, regex):
                if len(matches) >= SEARCH_MAX_MATCHES:
                    break
                matches.append({"path": file_rel, "line": line_no, "text": line})
                lines_out.append(f"{file_rel}:{line_no}: {line}")
            if len(matches) >= SEARCH_MAX_MATCHES:
                notes.append(f"[match cap {SEARCH_MAX_MATCHES} reached; narrow the search]")
                break
        text = "\n".join(lines_out + notes) if lines_out or notes else "no matches"
        truncated = bool(notes)
        return tool_result(text, {"path": rel, "matches": matches, "truncated": truncated})

    def _walk(self, start: str) -> Iterator[str]:
        """Regular files under ``start`` (or ``start`` itself), sorted, skipping .git and links."""
        try:
            st = os.lstat(start)
        except OSError as exc:
            raise ToolError(f"cannot search: {os_reason(exc)}") from None
        if stat.S_ISREG(st.st_mode):
            yield start
            return
        if not stat.S_ISDIR(st.st_mode):
            return
        for dirpath, dirnames, filenames in os.walk(start, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d.lower() != ".git")
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                try:
                    if stat.S_ISREG(os.lstat(path).st_mode):
                        yield path
                except OSError:
                    continue
