"""The runner's stop signals (SIGTERM, SIGINT), held back where a stop must not land.

A stop raises an exception in the main thread (the CLI's handlers raise
`RunInterrupted` or `KeyboardInterrupt`), and the run unwinds through its clean-up.
Landing between the engine creating a container and the run holding it, or
between a thread pool starting a thread and counting it (the pool's exit then
does not wait for the container that thread creates), it would leave a container
nobody removes. `held()` moves the stop to the end of such a section, and
`HeldPool` is a thread pool whose `submit` and whose wait at the end a stop
cannot cut.

Why not `pthread_sigmask`: Python runs a handler in the main thread whichever
thread the kernel gave the signal to, and the kernel gives it to any thread that
does not block it. A runner has several (pools, watchers, the engine client's),
so a mask on the main thread alone deferred nothing; a stopped chain left a step's
container behind that way. The hold is checked in the handler instead.

Only handlers installed with `on_stop` are held; elsewhere (a library caller with
its own handlers, a thread other than the main one) `held()` changes nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_depth = 0  # how many held() sections the main thread is in
_pending: tuple[int, Callable[[], BaseException]] | None = None  # the first held stop


def on_stop(signum: int, stop: Callable[[], BaseException]) -> None:
    """Make `signum` raise `stop()` in the main thread, at once or, inside `held()`,
    where the section ends.

    SIGINT is left alone when it is ignored (a job started in the background, as
    some CI runners start their commands, inherits it ignored): such a job is not
    meant to stop on it."""
    if signum == signal.SIGINT and signal.getsignal(signum) is signal.SIG_IGN:
        return

    def handler(received: int, frame: FrameType | None) -> None:
        global _pending
        if _depth:
            if _pending is None:
                _pending = (received, stop)
            return
        raise stop()

    signal.signal(signum, handler)


def pending() -> int | None:
    """The stop held back so far (its signal number), if any."""
    return _pending[0] if _pending is not None else None


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A stop that arrives inside is raised when the outermost section ends."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _pending is not None:
            (_, stop), _pending = _pending, None
            raise stop()


class HeldPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that creates a run's containers: leaving it waits for them.

    `submit` starts a thread and only then counts it for the wait in `shutdown`; a
    stop in between would unwind past a creation nobody waits for. The wait itself
    is held too, so a second stop cannot cut it."""

    def submit(
        self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[T]:
        with held():
            return super().submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with held():
            super().shutdown(wait=wait, cancel_futures=cancel_futures)
