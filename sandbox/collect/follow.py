"""Following a running step's action log: each guarded call, as the guard logs it.

A thread reads the new bytes of `test_mode_actions.jsonl` every `interval_s` and
hands each complete line, parsed, to a callback; `stop()` reads what is left once
the guard has stopped, so no line the guard wrote is missed. The file is opened
once without following a link; a line that does not parse, or is longer than the
guard ever writes, is skipped (the record's counts come from `actionsummary`, not
from here). The callback runs on the follower's thread and must not block for long.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

from sandbox.contracts.wire import ActionLine

READ_CHUNK = 64 * 1024
# Past the guard's own line cap (64 KiB, where it summarizes the arguments), with room.
MAX_LINE_BYTES = 256 * 1024


class ActionFollower:
    """Tails one action log on a thread of its own until `stop()`."""

    def __init__(
        self, path: Path, on_line: Callable[[ActionLine], None], *, interval_s: float = 0.05
    ) -> None:
        self._path = path
        self._on_line = on_line
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._fd: int | None = None
        self._pending = b""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="action-follower", daemon=True)

    def start(self) -> ActionFollower:
        with contextlib.suppress(OSError):
            self._fd = os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following; what the log holds by now is read first. Safe twice."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._read()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._read()

    def _read(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            while True:
                try:
                    chunk = os.read(self._fd, READ_CHUNK)
                except OSError:
                    return
                if not chunk:
                    return
                self._pending += chunk
                *lines, self._pending = self._pending.split(b"\n")
                if len(self._pending) > MAX_LINE_BYTES:
                    self._pending = b""  # longer than any line the guard writes
                for raw in lines:
                    self._emit(raw)

    def _emit(self, raw: bytes) -> None:
        if not raw.strip() or len(raw) > MAX_LINE_BYTES:
            return
        try:
            line = ActionLine.model_validate_json(raw)
        except ValueError:
            return
        with contextlib.suppress(Exception):
            self._on_line(line)
