"""A stop (SIGTERM, ^C) never lands where a container is made but not yet held.

These run in pytest's main thread, where Python runs signal handlers, with the
handlers put back after each test."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

from sandbox import stopsignals
from sandbox.stopsignals import HeldPool
from tests.polling import wait_for


class Stopped(BaseException):
    pass


@pytest.fixture(autouse=True)
def _handlers_restored() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


@pytest.fixture
def other_thread() -> Iterator[threading.Thread]:
    """A thread that does not block SIGTERM, as a runner's pools and watchers do not."""
    done = threading.Event()
    thread = threading.Thread(target=done.wait, daemon=True)
    thread.start()
    yield thread
    done.set()
    thread.join()


def test_a_stop_given_to_another_thread_waits_for_the_held_section(
    other_thread: threading.Thread,
) -> None:
    """The kernel gives a process's SIGTERM to any thread not blocking it, and Python
    then runs the handler in the main thread: a mask on the main thread alone (the
    old hold) let the stop through here."""
    stopsignals.on_stop(signal.SIGTERM, Stopped)
    assert other_thread.ident is not None
    with pytest.raises(Stopped):
        with stopsignals.held():
            signal.pthread_kill(other_thread.ident, signal.SIGTERM)
            wait_for(lambda: stopsignals.pending() == signal.SIGTERM, 10, "the stop held")
            still_inside = True  # reached: the stop did not cut the section
        pytest.fail("the held stop was not raised at the end of the section")
    assert still_inside
    assert stopsignals.pending() is None


def test_nested_sections_raise_the_stop_once_where_the_outermost_ends() -> None:
    stopsignals.on_stop(signal.SIGTERM, Stopped)
    reached = []
    with pytest.raises(Stopped):
        with stopsignals.held():
            with stopsignals.held():
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGTERM)
            reached.append("inner end")
        reached.append("outer end")  # never: the stop is raised as the outer one ends
    assert reached == ["inner end"]
    with stopsignals.held():
        pass  # nothing left over from the two signals


def test_outside_a_section_a_stop_raises_at_once() -> None:
    stopsignals.on_stop(signal.SIGTERM, Stopped)
    with pytest.raises(Stopped):
        signal.raise_signal(signal.SIGTERM)


def test_an_ignored_sigint_stays_ignored() -> None:
    """A job started in the background inherits SIGINT ignored; it is not meant to stop on it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopsignals.on_stop(signal.SIGINT, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_stop_while_the_pool_starts_its_thread_still_waits_for_the_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ThreadPoolExecutor counts a new thread for its final wait only after starting it;
    a stop in between unwound past work nobody waited for (a step's container created
    after the run's clean-up, left behind). The work here stands in for the engine's
    creation of a container, which takes a while."""
    stopsignals.on_stop(signal.SIGTERM, Stopped)
    done = threading.Event()

    def create_a_container() -> None:
        time.sleep(0.3)
        done.set()

    real_start = threading.Thread.start

    def start_then_stop(thread: threading.Thread) -> None:
        real_start(thread)
        signal.raise_signal(signal.SIGTERM)  # the stop lands as the pool counts its thread

    with pytest.raises(Stopped), HeldPool(max_workers=1) as pool:
        monkeypatch.setattr(threading.Thread, "start", start_then_stop)
        try:
            pool.submit(create_a_container)
        finally:
            monkeypatch.undo()
    assert done.is_set(), "the pool's exit did not wait for the work submitted"
