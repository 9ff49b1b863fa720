"""Knobs that exist only for the project's own tests, kept off the public `RunOptions`.

A public caller cannot turn a wall off through the options it passes; the tests
that must prove a wall's own check catches its absence (the preflight seeing an
open namespace, the gate refusing a run without its firewall) weaken one run with
`weakened_for_tests(...)`, which this module holds for the runs planned inside the
block. A run planned that way records its walls as not full (`Walls.lacking`), so
it can never verify, and the gate refuses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class _TestKnobs:
    """What a test may weaken; the defaults are the product's."""

    # False leaves the run's firewall out (the preflight tests' open namespace).
    install_firewall: bool = True


_lock = threading.Lock()
_current = _TestKnobs()


def current() -> _TestKnobs:
    """The knobs a run being planned now reads (the product's, outside a test's block)."""
    return _current


@contextlib.contextmanager
def weakened_for_tests(*, install_firewall: bool = True) -> Iterator[None]:
    """TEST ONLY: the runs planned inside the block are built with these knobs."""
    global _current
    with _lock:
        before = _current
        _current = dataclasses.replace(before, install_firewall=install_firewall)
    try:
        yield
    finally:
        with _lock:
            _current = before
