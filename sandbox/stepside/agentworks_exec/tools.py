"""The step container's executor: runs local and DB tools as the step's own user.

The step container's command is wrapped as::

    python3 -m agentworks_exec -- <step argv...>

(in the step image this package is ``agentworks_exec``; in this repository it is
``sandbox.stepside.agentworks_exec``).
The guard decides policy; this wrapper only *executes* what the guard allowed,
inside the step container, with exactly the step's uid, mounts and limits. It
therefore never grants more than the step already has: the container is the
boundary, the checks here keep tool calls inside the group folder and make
every failure a readable tool result.

Standard library only: the ``sandbox`` package (and pydantic) are not in the
step image. The JSON shapes are those of ``sandbox.contracts.wire.ExecRequest`` (request)
and ``sandbox.contracts.wire.ToolResult`` (reply), written by hand.

Start-up (:func:`main`):

* ``AGENTWORKS_EXEC_PORT`` and ``AGENTWORKS_EXEC_TOKEN`` are read and removed
  from the environment, so the step command never inherits them, and the
  process makes itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``) so
  same-uid processes cannot read its ``/proc/<pid>/environ`` or memory.
* No port: the step command is ``exec``-ed in place (no server).
* Port but no token: refuse to start (exit 2); an unauthenticated executor is
  a configuration bug, and we fail closed.
* Otherwise an HTTP server is bound to ``127.0.0.1:<port>`` *before* the step
  command starts; the step runs as a child (stdin/stdout/stderr inherited),
  SIGTERM/SIGINT/SIGHUP are forwarded to it, and the wrapper exits with its
  exit code (``128 + signal`` when it died of a signal; 127 when it cannot be
  found, 126 when it cannot be executed).

When this wrapper is PID 1 of a container, run the container with an init
(``docker run --init``) so orphaned grandchildren are reaped.

HTTP API (quiet: nothing is logged, stderr belongs to the step):

* ``GET /v1/health`` -> ``200 {"ok": true}`` (no auth).
* ``POST /v1/exec`` with ``Authorization: Bearer <token>`` and a JSON body
  ``{"tool": str, "arguments": {...}}`` (at most 4 MiB) -> ``200`` with
  ``{"text": str, "data": any, "is_error": bool}``. Bad or missing token: 401;
  body too big: 413; malformed body: 400; all as ``{"error": "..."}``. A tool
  call never fails at the HTTP level: refusals, errors and exceptions are
  ``is_error: true`` results with a clear text.

Tools (every path is relative to ROOT = the start-up cwd, i.e. the group
folder, or ``$AGENTWORKS_EXEC_ROOT``; it goes through
:func:`check_tool_path` and must still be inside ROOT after resolving
symlinks):

* ``read_file {path, offset=0, limit=2000}``: raw text of lines
  ``[offset, offset+limit)`` (0-based), at most 256 KiB.
* ``write_file {path, content}``: creates parent folders; never writes through
  a symlink (``O_NOFOLLOW``).
* ``edit_file {path, old, new}``: ``old`` must occur exactly once.
* ``list_dir {path="."}``: sorted; folders end in ``/``; links are
  ``name -> target``; at most 1000 entries.
* ``search_files {pattern, path=".", glob?}``: Python regex; ``relpath:lineno:
  line`` (path relative to ROOT); skips ``.git``, symlinks, binary files and
  files over 2 MiB; at most 500 matches. ``glob`` is matched (fnmatch) against
  the file name, or against the ROOT-relative path when it contains ``/``.
* ``execute_shell_command {command, timeout_s=120}``: ``/bin/sh -c`` in ROOT,
  in its own session/process group; timeout clamped to [1, 600] s. The call
  ends when the shell has exited *and* its output is closed, or at the
  deadline, when the whole process group is killed (SIGKILL). Background
  processes that detach their output (``cmd > log 2>&1 &``) keep running.
  ``data = {"exit_code", "timed_out", "timeout_s"}`` (exit code ``128 + sig``
  when killed by a signal); ``text`` is the last 8,000 characters of the
  combined stdout+stderr; ``is_error`` when it timed out or exited non-zero.
* ``query_workflow_db {sql, params=[]}``: one statement on ``$DB_PATH``
  (read at call time) opened read-only (``mode=ro`` and ``query_only``);
  ``data = {"columns", "rows", "truncated"}`` (1000 rows at most, blobs as
  hex).
* ``mutate_workflow_db`` / ``agentworks_db {sql, params=[]}``: one statement,
  read-write, committed; ``data = {"rowcount", "lastrowid"}`` plus
  ``"columns"``/``"rows"`` when the statement returns rows.

Both DB connections use a 10 s busy timeout, refuse ``ATTACH`` (only the DB
copy is reachable) and interrupt a statement after 60 s. Which SQL is allowed
at all is the guard's decision, not this module's.

Known limits: paths are checked and then used, so a step that swaps a folder
for a symlink at the same moment can race the check; that gains it nothing it
could not do itself (same uid, same mounts). A pathological regular
expression can keep one server thread busy.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import errno
import fnmatch
import hmac
import json
import math
import os
import re
import selectors
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any, Final, cast

from .pathsafety import check_tool_path, normalize_tool_path
from .preflight import gate as preflight_gate
from .toolargs import (
    DB_BUSY_TIMEOUT_S,
    DB_STATEMENT_DEADLINE_S,
    SEARCH_DEADLINE_S,
    SHELL_KILL_GRACE_S,
    shell_timeout_s,
)

__all__ = ["Executor", "main"]

PORT_ENV: Final = "AGENTWORKS_EXEC_PORT"
TOKEN_ENV: Final = "AGENTWORKS_EXEC_TOKEN"
ROOT_ENV: Final = "AGENTWORKS_EXEC_ROOT"
DB_ENV: Final = "DB_PATH"
# host:port of the guard; the step command starts only once the guard listens there.
GUARD_WAIT_ENV: Final = "AGENTWORKS_WAIT_FOR_GUARD"
GUARD_WAIT_S: Final = 60.0
GUARD_DOWN_EXIT: Final = 125

MAX_REQUEST_BYTES: Final = 4 * 1024 * 1024  # same as sandbox.contracts.wire.MAX_REQUEST_BYTES
MAX_DRAIN_BYTES: Final = 16 * 1024 * 1024  # read and drop an oversized body up to this
SOCKET_TIMEOUT_S: Final = 60.0

READ_DEFAULT_LIMIT: Final = 2000
READ_MAX_BYTES: Final = 256 * 1024
EDIT_MAX_BYTES: Final = 16 * 1024 * 1024
LIST_MAX_ENTRIES: Final = 1000
SEARCH_MAX_MATCHES: Final = 500
SEARCH_MAX_FILE_BYTES: Final = 2 * 1024 * 1024
SEARCH_MAX_LINE_CHARS: Final = 300
SEARCH_MAX_PATTERN_CHARS: Final = 1000
BINARY_SNIFF_BYTES: Final = 8192
SHELL_TAIL_CHARS: Final = 8000
DB_MAX_ROWS: Final = 1000
DB_TEXT_ROWS: Final = 20
DB_TEXT_CELL_CHARS: Final = 60

PR_SET_DUMPABLE: Final = 4
FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class ToolError(Exception):
    """A tool call that cannot be done; its message is the result's text."""


def _result(text: str, data: Any = None, *, is_error: bool = False) -> dict[str, Any]:
    return {"text": text, "data": data, "is_error": is_error}


# --------------------------------------------------------------------------- arguments


def _str_arg(args: dict[str, Any], name: str, default: str | None = None) -> str:
    value = args.get(name, default)
    if value is None:
        raise ToolError(f"missing argument '{name}'")
    if not isinstance(value, str):
        raise ToolError(f"argument '{name}' must be a string")
    return value


def _int_arg(args: dict[str, Any], name: str, default: int, minimum: int) -> int:
    value = args.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool):
        raise ToolError(f"argument '{name}' must be an integer")
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ToolError(f"argument '{name}' must be an integer") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise ToolError(f"argument '{name}' must be an integer")
    if value < minimum:
        raise ToolError(f"argument '{name}' must be at least {minimum}")
    return value


def _timeout_arg(args: dict[str, Any]) -> float:
    try:
        return shell_timeout_s(args.get("timeout_s"))
    except ValueError as exc:
        raise ToolError(str(exc)) from None


def _params_arg(args: dict[str, Any]) -> list[Any] | dict[str, Any]:
    value = args.get("params")
    if value is None:
        return []
    if isinstance(value, list | dict):
        return value
    raise ToolError("argument 'params' must be a list (or an object of named parameters)")


# --------------------------------------------------------------------------- paths


def _inside(root: str, path: str) -> bool:
    return path == root or os.path.commonpath([root, path]) == root


def _open_regular(path: str, flags: int) -> int:
    """Open without following a final link and without blocking on a FIFO; regular files only."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ToolError(_os_reason(exc)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ToolError("not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _os_reason(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "no such file or folder"
    if isinstance(exc, IsADirectoryError):
        return "is a folder, not a file"
    if isinstance(exc, NotADirectoryError):
        return "a part of the path is not a folder"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return exc.strerror or str(exc)


# --------------------------------------------------------------------------- output tail


class _Tail:
    """Keeps the last ``limit`` characters of a byte stream decoded as UTF-8."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self.total = 0

    def feed(self, chunk: bytes, *, final: bool = False) -> None:
        text = self._decoder.decode(chunk, final=final)
        self.total += len(text)
        self._buf += text
        if len(self._buf) > 2 * self._limit:
            self._buf = self._buf[-self._limit :]

    def text(self) -> str:
        self.feed(b"", final=True)
        tail = self._buf[-self._limit :]
        cut = self.total - len(tail)
        return f"[... {cut} chars cut]\n{tail}" if cut > 0 else tail


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


# --------------------------------------------------------------------------- DB helpers


def _json_cell(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _text_cell(value: Any) -> str:
    text = "NULL" if value is None else str(value)
    text = text.replace("\n", "\\n")
    if len(text) > DB_TEXT_CELL_CHARS:
        text = text[: DB_TEXT_CELL_CHARS - 1] + "…"
    return text


def _text_table(columns: list[str], rows: list[list[Any]], truncated: bool) -> str:
    count = f"{len(rows)} row{'s' if len(rows) != 1 else ''}"
    if truncated:
        count += f" (capped at {DB_MAX_ROWS}; more rows exist)"
    if not columns:
        return count
    lines = [" | ".join(columns)]
    lines += [" | ".join(_text_cell(v) for v in row) for row in rows[:DB_TEXT_ROWS]]
    if len(rows) > DB_TEXT_ROWS:
        lines.append(f"... {len(rows) - DB_TEXT_ROWS} more rows in data")
    lines.append(count)
    return "\n".join(lines)


# --------------------------------------------------------------------------- executor


class Executor:
    """The local and DB tools, rooted at one folder."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self._tools: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "read_file": self.read_file,
            "write_file": self.write_file,
            "edit_file": self.edit_file,
            "list_dir": self.list_dir,
            "search_files": self.search_files,
            "execute_shell_command": self.execute_shell_command,
            "query_workflow_db": self.query_workflow_db,
            "mutate_workflow_db": self.mutate_workflow_db,
            "agentworks_db": self.mutate_workflow_db,
        }

    def call(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Run one tool; never raises, every failure is an ``is_error`` result."""
        handler = self._tools.get(tool)
        if handler is None:
            return _result(f"unknown local tool: {tool!r}", is_error=True)
        try:
            return handler(arguments)
        except ToolError as exc:
            return _result(f"{tool}: {exc}", is_error=True)
        except Exception as exc:
            return _result(f"{tool}: internal error: {type(exc).__name__}: {exc}", is_error=True)

    # ---------------------------------------------------------------- paths

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
            raise ToolError(f"cannot write {rel}: {_os_reason(exc)}") from None
        with os.fdopen(fd, "wb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ToolError(f"cannot write {rel}: not a regular file")
            os.set_blocking(handle.fileno(), True)
            handle.write(data)

    # ---------------------------------------------------------------- files

    def read_file(self, args: dict[str, Any]) -> dict[str, Any]:
        rel, real = self._real(args.get("path"))
        offset = _int_arg(args, "offset", 0, 0)
        limit = _int_arg(args, "limit", READ_DEFAULT_LIMIT, 1)
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
        return _result(text, data)

    def write_file(self, args: dict[str, Any]) -> dict[str, Any]:
        content = _str_arg(args, "content")
        rel, target = self._write_target(args.get("path"))
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        except OSError as exc:
            raise ToolError(f"cannot create the folder for {rel}: {_os_reason(exc)}") from None
        # The folders now exist: check again that they resolve inside ROOT.
        rel, target = self._write_target(rel)
        data = content.encode("utf-8", errors="surrogateescape")
        self._write_bytes(rel, target, data)
        return _result(f"wrote {len(data)} bytes to {rel}", {"path": rel, "bytes": len(data)})

    def edit_file(self, args: dict[str, Any]) -> dict[str, Any]:
        old = _str_arg(args, "old")
        new = _str_arg(args, "new")
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
        return _result(f"edited {rel}", {"path": rel, "bytes": len(updated)})

    def list_dir(self, args: dict[str, Any]) -> dict[str, Any]:
        rel, real = self._real(args.get("path", "."))
        try:
            with os.scandir(real) as scan:
                found = sorted(scan, key=lambda e: e.name)
        except OSError as exc:
            raise ToolError(f"cannot list {rel}: {_os_reason(exc)}") from None
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
        return _result(text, {"path": rel, "entries": entries, "truncated": truncated})

    def search_files(self, args: dict[str, Any]) -> dict[str, Any]:
        pattern = _str_arg(args, "pattern")
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
        return _result(text, {"path": rel, "matches": matches, "truncated": truncated})

    def _walk(self, start: str) -> Iterator[str]:
        """Regular files under ``start`` (or ``start`` itself), sorted, skipping .git and links."""
        try:
            st = os.lstat(start)
        except OSError as exc:
            raise ToolError(f"cannot search: {_os_reason(exc)}") from None
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

    # ---------------------------------------------------------------- shell

    def execute_shell_command(self, args: dict[str, Any]) -> dict[str, Any]:
        command = _str_arg(args, "command")
        if "\x00" in command:
            raise ToolError("command contains a NUL byte")
        timeout = _timeout_arg(args)
        # Held from the fork until the pid is registered: a command that exits at once
        # must not be reaped as a stranger (its `wait()` would then report exit 0).
        with _SPAWN_LOCK:
            try:
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", command],
                    cwd=self.root,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ToolError(f"cannot start /bin/sh: {_os_reason(exc)}") from None
            _OWN_CHILDREN.add(proc.pid)
        assert proc.stdout is not None
        tail = _Tail(SHELL_TAIL_CHARS)
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            eof = _pump(proc.stdout.fileno(), tail, deadline)
            if eof:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
            else:
                timed_out = True
            if timed_out:
                _kill_group(proc.pid)
                _pump(proc.stdout.fileno(), tail, time.monotonic() + SHELL_KILL_GRACE_S)
            returncode = proc.wait()
        finally:
            proc.stdout.close()
            if proc.returncode is None:
                _kill_group(proc.pid)
                proc.wait()
            _OWN_CHILDREN.discard(proc.pid)
        exit_code = _exit_code(returncode)
        text = tail.text()
        if timed_out:
            note = f"[timed out after {timeout:g} s: the command's process group was killed]"
            text = f"{text}\n{note}" if text else note
        data = {"exit_code": exit_code, "timed_out": timed_out, "timeout_s": timeout}
        return _result(text, data, is_error=timed_out or exit_code != 0)

    # ---------------------------------------------------------------- DB

    def _connect(self, *, read_only: bool) -> sqlite3.Connection:
        db_path = os.environ.get(DB_ENV, "")
        if not db_path:
            raise ToolError("no DB in this test run")
        mode = "ro" if read_only else "rw"
        uri = f"file:{urllib.parse.quote(os.path.abspath(db_path))}?mode={mode}"
        try:
            conn = sqlite3.connect(uri, uri=True, timeout=DB_BUSY_TIMEOUT_S)
        except sqlite3.Error as exc:
            raise ToolError(f"cannot open the DB copy: {exc}") from None
        try:
            conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
            if read_only:
                conn.execute("PRAGMA query_only = ON")
            stop_at = time.monotonic() + DB_STATEMENT_DEADLINE_S
            conn.set_progress_handler(lambda: int(time.monotonic() > stop_at), 10_000)
        except BaseException:
            conn.close()
            raise
        return conn

    def _run_sql(self, args: dict[str, Any], *, read_only: bool) -> dict[str, Any]:
        sql = _str_arg(args, "sql")
        params = _params_arg(args)
        conn = self._connect(read_only=read_only)
        try:
            try:
                cursor = conn.execute(sql, params)
                columns = [d[0] for d in cursor.description or ()]
                fetched = cursor.fetchmany(DB_MAX_ROWS + 1) if columns else []
                if not read_only:
                    conn.commit()
            except (sqlite3.Error, ValueError, OverflowError) as exc:
                message = str(exc)
                if message == "interrupted":
                    message = f"statement interrupted after {DB_STATEMENT_DEADLINE_S:.0f} s"
                raise ToolError(f"statement failed: {message}") from None
            truncated = len(fetched) > DB_MAX_ROWS
            rows = [[_json_cell(v) for v in row] for row in fetched[:DB_MAX_ROWS]]
            if read_only:
                data: dict[str, Any] = {"columns": columns, "rows": rows, "truncated": truncated}
                return _result(_text_table(columns, rows, truncated), data)
            data = {"rowcount": cursor.rowcount, "lastrowid": cursor.lastrowid}
            text = f"ok: {cursor.rowcount} row(s) changed, last row id {cursor.lastrowid}"
            if columns:
                data.update(columns=columns, rows=rows, truncated=truncated)
                text += "\n" + _text_table(columns, rows, truncated)
            return _result(text, data)
        finally:
            conn.close()

    def query_workflow_db(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._run_sql(args, read_only=True)

    def mutate_workflow_db(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._run_sql(args, read_only=False)


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


def _pump(fd: int, tail: _Tail, deadline: float) -> bool:
    """Read ``fd`` into ``tail`` until EOF (True) or ``deadline`` (False)."""
    os.set_blocking(fd, False)
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if not selector.select(timeout=remaining):
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                return True
            tail.feed(chunk)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# --------------------------------------------------------------------------- HTTP


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, token: str, executor: Executor) -> None:
        self.expected_auth = f"Bearer {token}".encode()
        self.executor = executor
        super().__init__(("127.0.0.1", port), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Stay quiet: stderr is the step's."""


class _Handler(BaseHTTPRequestHandler):
    server_version = "agentworks-exec/1"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        """No per-request lines: stderr is the step's own output."""

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            self.close_connection = True

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path == "/v1/health":
            self._reply(200, {"ok": True})
        elif path == "/v1/exec":
            self._reply(405, {"error": "use POST for /v1/exec"})
        else:
            self._reply(404, {"error": f"no such endpoint: {path}"})

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path != "/v1/exec":
            self._discard_body()
            self._reply(404, {"error": f"no such endpoint: {path}"})
            return
        server = cast(_Server, self.server)
        given = self.headers.get("Authorization", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, server.expected_auth):
            self._discard_body()
            self._reply(401, {"error": "missing or wrong bearer token"})
            return
        length = self._content_length()
        if length is None:
            return
        if length > MAX_REQUEST_BYTES:
            self._discard_body()
            self._reply(413, {"error": f"request body is larger than {MAX_REQUEST_BYTES} bytes"})
            return
        try:
            body = self.rfile.read(length)
        except OSError:
            self.close_connection = True
            return
        request = _parse_exec_request(body)
        if isinstance(request, str):
            self._reply(400, {"error": request})
            return
        tool, arguments = request
        self._reply(200, server.executor.call(tool, arguments))

    def _content_length(self) -> int | None:
        raw = self.headers.get("Content-Length")
        if raw is None:
            self.close_connection = True
            self._reply(411, {"error": "Content-Length is required"})
            return None
        try:
            length = int(raw)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            self._reply(400, {"error": "invalid Content-Length"})
            return None
        return length

    def _discard_body(self) -> None:
        """Read and drop a body we will not use (so the client sees our reply, not a reset)."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if length < 0 or length > MAX_DRAIN_BYTES:
            self.close_connection = True
            return
        try:
            while length > 0:
                chunk = self.rfile.read(min(length, 65536))
                if not chunk:
                    break
                length -= len(chunk)
        except OSError:
            self.close_connection = True


def _parse_exec_request(body: bytes) -> tuple[str, dict[str, Any]] | str:
    """(tool, arguments) of an ExecRequest body, or the reason it is malformed."""
    try:
        request = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"body is not valid JSON: {exc}"
    if not isinstance(request, dict):
        return "body must be a JSON object"
    extra = sorted(set(request) - {"tool", "arguments"})
    if extra:
        return f"unexpected fields: {', '.join(extra)}"
    tool = request.get("tool")
    if not isinstance(tool, str) or not tool:
        return "'tool' must be a non-empty string"
    arguments = request.get("arguments", {})
    if not isinstance(arguments, dict):
        return "'arguments' must be a JSON object"
    return tool, arguments


# --------------------------------------------------------------------------- main


def _no_dump() -> None:
    """Best effort: same-uid processes may not read our memory or /proc/<pid>/environ."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _usage(message: str) -> int:
    print(f"agentworks_exec: {message}", file=sys.stderr)
    print("usage: python3 -m agentworks_exec -- <command> [args...]", file=sys.stderr)
    return 2


def _launch_error(cmd: Sequence[str], exc: OSError) -> int:
    print(f"agentworks_exec: cannot run {cmd[0]!r}: {_os_reason(exc)}", file=sys.stderr)
    return 127 if isinstance(exc, FileNotFoundError) else 126


def _wait_for_guard(address: str, deadline_s: float = GUARD_WAIT_S) -> bool:
    """True once something listens at `address` (the guard binds only when it is ready).

    The runner starts the step as soon as the firewall is in, while the guard is
    still importing; the step's first bridge call must not find nobody home."""
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        return False
    end = time.monotonic() + deadline_s
    pause = 0.002
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= end:
                return False
            time.sleep(pause)  # a refused connect returns at once: back off a little
            pause = min(pause * 2, 0.01)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the step command under the executor; returns the step's exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    cmd = args[1:] if args[:1] == ["--"] else args
    if not cmd:
        return _usage("no step command given")
    port_text = os.environ.pop(PORT_ENV, "").strip()
    token = os.environ.pop(TOKEN_ENV, "")
    _no_dump()
    refused = preflight_gate()  # the ways out must be closed before the step starts
    if refused is not None:
        return refused
    guard = os.environ.pop(GUARD_WAIT_ENV, "")
    if guard and not _wait_for_guard(guard):
        print(
            f"agentworks_exec: the run's guard did not answer at {guard} within"
            f" {GUARD_WAIT_S:.0f} s; the step was not started",
            file=sys.stderr,
        )
        return GUARD_DOWN_EXIT
    if not port_text:
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            return _launch_error(cmd, exc)
    try:
        port = int(port_text)
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        return _usage(f"{PORT_ENV} must be a TCP port number, not {port_text!r}")
    if not token:
        return _usage(f"{PORT_ENV} is set but {TOKEN_ENV} is empty; refusing to serve")
    executor = Executor(os.environ.get(ROOT_ENV) or os.getcwd())
    try:
        server = _Server(port, token, executor)
    except OSError as exc:
        print(f"agentworks_exec: cannot listen on 127.0.0.1:{port}: {exc}", file=sys.stderr)
        return 2
    del token
    threading.Thread(target=server.serve_forever, name="agentworks-exec", daemon=True).start()
    return _run_step(cmd)


def _run_step(cmd: list[str]) -> int:
    """Run the step as a child, forwarding termination signals; its exit code."""
    child: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if not child:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            child[0].send_signal(signum)

    for signum in FORWARDED_SIGNALS:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, forward)
    try:
        child.append(subprocess.Popen(cmd))
    except OSError as exc:
        return _launch_error(cmd, exc)
    for early in pending:
        with contextlib.suppress(ProcessLookupError):
            child[0].send_signal(early)
    _reap_until_exit(child[0].pid)
    code = _exit_code(child[0].wait())
    _report_usage()
    return code


USAGE_MARK: Final = "AGENTWORKS_USAGE"
# The container's own memory high-water mark (page cache and tmpfs included), as the
# kernel keeps it: cgroup v2, then v1 (the container has its own cgroup namespace).
CGROUP_PEAK_FILES: Final = (
    "/sys/fs/cgroup/memory.peak",
    "/sys/fs/cgroup/memory/memory.max_usage_in_bytes",
)


def _cgroup_memory_peak() -> int | None:
    for path in CGROUP_PEAK_FILES:
        try:
            with open(path, encoding="ascii") as handle:
                return int(handle.read().strip())
        except (OSError, ValueError):
            continue
    return None


def _report_usage() -> None:
    """The step's CPU time and largest RSS (rusage of every reaped descendant), on stderr.

    Engine stats are sampled and can miss a short step entirely; this cannot."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    report: dict[str, float | int] = {
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 6),
        "max_rss_bytes": int(usage.ru_maxrss) * 1024,
    }
    peak = _cgroup_memory_peak()
    if peak is not None:
        report["cgroup_peak_bytes"] = peak
    with contextlib.suppress(OSError):
        os.write(2, f"{USAGE_MARK} {json.dumps(report)}\n".encode())


# Children that a tool thread waits for itself; the reaper leaves them alone. A tool
# thread holds the lock from fork to registration, the reaper while it decides.
_OWN_CHILDREN: set[int] = set()
_SPAWN_LOCK = threading.Lock()


def _reap_until_exit(step_pid: int) -> None:
    """Wait for the step, reaping orphans on the way.

    The executor runs as the container's pid 1 (no docker-init: an init process would
    keep the whole container environment, executor token included, readable by the
    step in /proc/1/environ), so orphaned grandchildren are re-parented to it. Peek
    with WNOWAIT, reap strangers, and leave the step and tool children to their own
    `wait()`."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            return
        except InterruptedError:
            continue
        if info is None:
            continue
        if info.si_pid == step_pid:
            return
        with _SPAWN_LOCK:
            ours = info.si_pid in _OWN_CHILDREN
            if not ours:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(info.si_pid, 0)
        if ours:
            time.sleep(0.01)  # its tool thread is about to reap it
