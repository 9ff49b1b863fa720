"""The shell tool: one command in its own process group, killed whole at its deadline."""

from __future__ import annotations

import codecs
import contextlib
import os
import selectors
import signal
import subprocess
import time
from typing import Any, Final

from .children import OWN_CHILDREN, SPAWN_LOCK, exit_status
from .results import ToolError, os_reason, str_arg, timeout_arg, tool_result
from .toolargs import (
    SHELL_KILL_GRACE_S,
)

SHELL_TAIL_CHARS: Final = 8000


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


class ShellTool:
    """`execute_shell_command`, run in `root`."""

    root: str

    def execute_shell_command(self, args: dict[str, Any]) -> dict[str, Any]:
        command = str_arg(args, "command")
        if "\x00" in command:
            raise ToolError("command contains a NUL byte")
        timeout = timeout_arg(args)
        # Held from the fork until the pid is registered: a command that exits at once
        # must not be reaped as a stranger (its `wait()` would then report exit 0).
        with SPAWN_LOCK:
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
                raise ToolError(f"cannot start /bin/sh: {os_reason(exc)}") from None
            OWN_CHILDREN.add(proc.pid)
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
            OWN_CHILDREN.discard(proc.pid)
        exit_code = exit_status(returncode)
        text = tail.text()
        if timed_out:
            note = f"[timed out after {timeout:g} s: the command's process group was killed]"
            text = f"{text}\n{note}" if text else note
        data = {"exit_code": exit_code, "timed_out": timed_out, "timeout_s": timeout}
        return tool_result(text, data, is_error=timed_out or exit_code != 0)
