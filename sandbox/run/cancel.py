"""Stopping a run from outside it: a signal in the main thread, or `cancel()` from any thread.

Both end the run the same way: `RunInterrupted` raised in the run's own thread,
where its clean-up unwinds (every container removed, the record written `killed`).
A signal raises it wherever the main thread is (`sandbox.stopsignals` holds it back
where a container is being created). A `Cancel` cannot raise into another thread,
so it asks: the run checks it between its phases and at each step of a chain, and
the step, the one phase that can last, is killed at once so its wait returns.
Nothing is raised inside a container's creation, so no hold is needed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable


class RunInterrupted(BaseException):
    """The runner was told to stop (SIGTERM, or `cancel()`): the record says `killed`."""


class Cancel:
    """One run's stop request; thread-safe, and set once for good."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requested = False
        self._hooks: list[Callable[[], None]] = []

    def request(self) -> None:
        """Ask the run to stop; what it registered to end its wait runs now, here."""
        with self._lock:
            if self._requested:
                return
            self._requested = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            # The run's own clean-up removes whatever a failed hook leaves.
            with contextlib.suppress(Exception):
                hook()

    @property
    def requested(self) -> bool:
        return self._requested

    def on_request(self, hook: Callable[[], None]) -> None:
        """Call `hook` when the stop is asked (at once if it already was)."""
        with self._lock:
            if not self._requested:
                self._hooks.append(hook)
                return
        with contextlib.suppress(Exception):
            hook()

    def check(self) -> None:
        """Raise `RunInterrupted` in the run's thread if the stop was asked."""
        if self._requested:
            raise RunInterrupted()
