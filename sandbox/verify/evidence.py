"""What a verification judges: the run's record, its action log and the files its step left.

All of it is read as untrusted input. The action log is written by the guard
alone, but it is opened without following links, size-capped, and every line
validated (lines that do not parse are counted, never used). The files of the
group folder are the step's own output: opened fd by fd from the run folder
without following any link, regular files only, capped in size.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from sandbox.contracts.record import FileChanges, RunStatus, TestRunRecord
from sandbox.contracts.reports import DbDiff
from sandbox.contracts.wire import ActionLine

MAX_LOG_BYTES = 64 * 1024 * 1024
MAX_FILE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Call:
    """One guarded call: its `call` or `start` line (1-based line number), and the
    outcome line of a forwarded call, if the guard wrote it."""

    lineno: int
    line: ActionLine
    raw: str
    outcome: ActionLine | None = None
    # In a whole-workflow run: the chain step whose own log holds the line (the line
    # number is then the chain's action log's), else "".
    in_step: str = ""

    @property
    def method(self) -> str:
        return str(self.line.arguments.get("method", ""))

    @property
    def host(self) -> str:
        return str(self.line.detail.get("host", ""))

    def cite(self, limit: int = 400) -> str:
        """The action-log line that decided, as a reader can find it in the file."""
        text = self.raw if len(self.raw) <= limit else self.raw[: limit - 3] + "..."
        step = f" (step {self.in_step})" if self.in_step else ""
        return f"action log line {self.lineno}{step}: {text}"


class GroupFiles(Protocol):
    """What a file expectation reads: a group folder's changes and its files."""

    @property
    def files(self) -> FileChanges: ...
    @property
    def files_label(self) -> str: ...
    def read_group_file(self, rel: str) -> bytes | None: ...


class Facts(Protocol):
    """What the checks read: one step's run (`Evidence`) or a whole chain's."""

    def files_for(self, group: str | None) -> GroupFiles | None:
        """The group folder a file expectation looks at (None: there is none)."""
        ...

    @property
    def calls(self) -> list[Call]: ...
    @property
    def malformed_lines(self) -> int: ...
    @property
    def log_truncated(self) -> bool: ...
    @property
    def log_full(self) -> bool: ...
    @property
    def db_diff(self) -> DbDiff | None: ...
    @property
    def no_db(self) -> bool: ...
    @property
    def status(self) -> RunStatus: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def reason(self) -> str: ...


@dataclass
class Evidence:
    run_root: Path
    record: TestRunRecord
    calls: list[Call] = field(default_factory=list)
    malformed_lines: int = 0
    log_truncated: bool = False

    @property
    def log_full(self) -> bool:
        return self.record.actions.log_full

    @property
    def db_diff(self) -> DbDiff | None:
        return self.record.db_diff

    @property
    def no_db(self) -> bool:
        return self.record.no_db

    @property
    def status(self) -> RunStatus:
        return self.record.status

    @property
    def exit_code(self) -> int | None:
        return self.record.exit_code

    @property
    def reason(self) -> str:
        return self.record.reason

    @property
    def files(self) -> FileChanges:
        return self.record.files

    @property
    def files_label(self) -> str:
        return "record files"

    def files_for(self, group: str | None) -> GroupFiles | None:
        """The step's own group folder (a step's expectations name no other)."""
        return self if group is None or group == self.record.group else None

    def read_group_file(self, rel: str) -> bytes | None:
        """A regular file of the run's copy of the group folder (the step's output), or
        None if it is missing, not a regular file, reached through a link, or too big."""
        return read_below(self.run_root / self.record.group, rel, MAX_FILE_BYTES)


def fold_changes(changes: list[FileChanges]) -> FileChanges:
    """A group folder's changes over its steps in order, against the first one's start:
    made then changed is created, made then deleted is gone (not listed), deleted then
    made again is changed."""
    state: dict[str, str] = {}
    for step in changes:
        for path in step.created:
            state[path] = "changed" if state.get(path) == "deleted" else "created"
        for path in step.changed:
            state.setdefault(path, "changed")
        for path in step.deleted:
            if state.get(path) == "created":
                del state[path]
            else:
                state[path] = "deleted"
    return FileChanges(
        created=sorted(p for p, s in state.items() if s == "created"),
        changed=sorted(p for p, s in state.items() if s == "changed"),
        deleted=sorted(p for p, s in state.items() if s == "deleted"),
        truncated=any(c.truncated for c in changes),
    )


@dataclass(frozen=True)
class GroupFolder:
    """One group folder as the chain left it (`files` folded over its steps)."""

    group: str
    files: FileChanges
    root: Path | None  # the folder the group's last step left

    @property
    def files_label(self) -> str:
        return f"the chain's records, group {self.group}"

    def read_group_file(self, rel: str) -> bytes | None:
        return read_below(self.root, rel, MAX_FILE_BYTES) if self.root is not None else None


@dataclass
class ChainEvidence:
    """The chain as the checks read it: every step's calls (numbered as in the chain's
    log), the chain's DB diff and status, and each group folder as it ended."""

    groups: dict[str, GroupFolder] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    malformed_lines: int = 0
    log_truncated: bool = False
    log_full: bool = False
    db_diff: DbDiff | None = None
    no_db: bool = False
    status: RunStatus = RunStatus.RUNNING
    exit_code: int | None = None
    reason: str = ""

    def files_for(self, group: str | None) -> GroupFolder | None:
        return self.groups.get(group) if group is not None else None


def read_below(root: Path, rel: str, cap: int) -> bytes | None:
    parts = [p for p in Path(rel).parts if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts):
        return None
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(root, flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        for name in parts[:-1]:
            nxt = os.open(name, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        leaf = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        os.close(fd)
        return None
    os.close(fd)
    with os.fdopen(leaf, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap:
            return None
        data = handle.read(cap + 1)
    return data if len(data) <= cap else None


@dataclass(frozen=True)
class LogRead:
    """An action log as read once: its calls in order (outcomes joined), the lines
    that did not parse, whether it was cut at the cap, and how many lines it has."""

    calls: list[Call] = field(default_factory=list)
    malformed: int = 0
    truncated: bool = False
    lines: int = 0


def read_calls(path: Path) -> LogRead:
    """The log's calls in order, their outcomes joined (empty when it cannot be read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return LogRead()
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return LogRead()
        data = handle.read(MAX_LOG_BYTES + 1)
    truncated = len(data) > MAX_LOG_BYTES
    calls: list[Call] = []
    open_calls: dict[str, int] = {}
    malformed = 0
    raw_lines = data[:MAX_LOG_BYTES].splitlines()
    for lineno, raw in enumerate(raw_lines, start=1):
        try:
            line = ActionLine.model_validate_json(raw)
        except ValidationError:
            malformed += 1
            continue
        text = raw.decode("utf-8", "replace")
        if line.event == "log_full":
            continue
        if line.event == "outcome":
            index = open_calls.pop(line.call_id or "", None)
            if index is None or calls[index].line.tool != line.tool:
                malformed += 1
                continue
            begun = calls[index]
            calls[index] = Call(begun.lineno, begun.line, begun.raw, outcome=line)
            continue
        if line.event == "start":
            if not line.call_id or line.call_id in open_calls:
                malformed += 1
                continue
            open_calls[line.call_id] = len(calls)
        calls.append(Call(lineno, line, text))
    return LogRead(calls, malformed, truncated, len(raw_lines))
