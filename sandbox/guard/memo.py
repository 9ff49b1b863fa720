"""A bounded memo of a pure function's answers, kept by the guard's hot paths.

The guard remembers some answers by their input's bytes or text (a header line's
match, a forwarded head's facts, an argument key's credential check) because the
same inputs come request after request. What it remembers is chosen by the step or
a host, so every such memo is bounded the same way: only an input at most `longest`
long is kept, and a memo that holds `entries` answers already is emptied before the
next goes in (no eviction order to keep up per hit). `remember` is called only on a
miss: a hit is the caller's own dict lookup, with no call.
"""

from __future__ import annotations

from collections.abc import Hashable, Sized
from typing import Protocol, TypeVar


class _Key(Hashable, Sized, Protocol):
    pass


K = TypeVar("K", bound=_Key)
V = TypeVar("V")


def remember(memo: dict[K, V], key: K, value: V, *, entries: int, longest: int) -> None:
    """Keep `key`'s `value` in `memo` when `key` is at most `longest` long; a memo
    holding `entries` answers already is emptied first. At most `entries` answers,
    each for a key at most `longest` long, whatever is asked."""
    if len(key) <= longest:
        if len(memo) >= entries:
            memo.clear()
        memo[key] = value
