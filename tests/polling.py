"""Waiting for something in a test: poll with a deadline, never a bare sleep.

A test that waits for a process, a container or a file asks `wait_for`; under load
the wait takes longer, the test does not flake, and a deadline that passes names
what never happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_INTERVAL_S = 0.05


def wait_for(probe: Callable[[], T], deadline_s: float, what: str) -> T:
    """Poll `probe` until it returns something truthy, and return that; AssertionError
    naming `what` once `deadline_s` passed."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {deadline_s:g} s waiting for {what}")
        time.sleep(POLL_INTERVAL_S)
