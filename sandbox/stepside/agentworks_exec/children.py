"""The executor's own children: which ones a tool thread waits for itself (so the
pid-1 reaper leaves them alone) and how an exit status becomes an exit code.

Its own small module, free of `subprocess`, so the supervisor can load it before
the step starts without loading the tools (see `supervisor`: the start-up path)."""

from __future__ import annotations

import threading

# Children that a tool thread waits for itself; the reaper leaves them alone. A tool
# thread holds the lock from fork to registration, the reaper while it decides.
OWN_CHILDREN: set[int] = set()


SPAWN_LOCK = threading.Lock()


def exit_status(returncode: int) -> int:
    """A `Popen.returncode` (minus the signal for a child killed by one) as the shell
    would report it: 128 + signal."""
    return 128 - returncode if returncode < 0 else returncode
