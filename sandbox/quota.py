"""The disk quota on a test run's writable folders.

A thread measures the group folder and the DB copy's folder (allocated blocks,
walked on directory fds without following links) a few times a second while
the step runs; past the quota it calls `on_exceeded` once (the runner stops
the step and records `quota`). A step can overshoot by what it writes in one
interval; the host's disk is protected by stopping it, not by a filesystem
limit.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

INTERVAL_S = 0.2


def used_bytes(roots: list[Path]) -> int:
    total = 0
    for root in roots:
        if not root.is_dir() or root.is_symlink():
            continue
        for _dirpath, dirnames, filenames, dirfd in os.fwalk(root, follow_symlinks=False):
            for name in [*dirnames, *filenames]:
                try:
                    total += os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_blocks * 512
                except OSError:
                    continue
    return total


class QuotaWatch:
    def __init__(self, roots: list[Path], quota_bytes: int, on_exceeded: Callable[[int], None]):
        self._roots = roots
        self._quota = quota_bytes
        self._on_exceeded = on_exceeded
        self._stop = threading.Event()
        self.peak_bytes = 0
        self.exceeded = False
        self._thread = threading.Thread(target=self._run, name="quota", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            used = used_bytes(self._roots)
            self.peak_bytes = max(self.peak_bytes, used)
            if used > self._quota:
                self.exceeded = True
                self._on_exceeded(used)
                return
            self._stop.wait(INTERVAL_S)

    def cancel(self) -> None:
        """Stop watching without a final measurement; safe before start and twice."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def stop(self) -> int:
        """Stop watching; the final usage (measured once more)."""
        self._stop.set()
        self._thread.join(timeout=30)
        final = used_bytes(self._roots)
        self.peak_bytes = max(self.peak_bytes, final)
        return final
