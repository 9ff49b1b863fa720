"""The engine layer: containers a run creates never outlive it, even when it is interrupted."""

from __future__ import annotations

import os
import random
import signal
import threading
import uuid
from collections.abc import Iterator

import pytest
from docker import DockerClient

from sandbox import stopsignals
from sandbox.backends.docker import containers
from sandbox.backends.docker.containers import OwnedContainers
from sandbox.contracts import names
from sandbox.contracts.names import LABEL_MANAGED
from sandbox.contracts.spec import ContainerSpec


class Interrupted(BaseException):
    """What the CLI's SIGTERM handler raises (RunInterrupted), stood in for here."""


@pytest.fixture
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises as the CLI makes it (`stopsignals.on_stop`)."""
    previous = signal.getsignal(signal.SIGTERM)
    stopsignals.on_stop(signal.SIGTERM, Interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _spec(label: str, n: int) -> ContainerSpec:
    return ContainerSpec(
        name=f"sandbox-owned-test-{label}-{n}",
        image=names.STEP_IMAGE,
        command=["true"],
        user="10001:10001",
        labels={"sandbox.test-owned": label},
    )


def _mine(client: DockerClient, label: str) -> list[str]:
    found = client.containers.list(
        all=True,
        filters={"label": [LABEL_MANAGED, f"sandbox.test-owned={label}"]},
        ignore_removed=True,
    )
    return [str(c.name) for c in found]


def test_a_signal_at_any_moment_of_creation_leaves_no_container(
    engine: DockerClient, sigterm_raises: None
) -> None:
    """SIGTERM lands at random points while containers are being created; every
    container the engine made is removed when the owner's block ends. The signal is
    sent to the process, as `kill` sends it: the kernel may give it to the timer's
    thread, and Python still runs the handler in the main thread."""
    label = uuid.uuid4().hex[:10]
    assert threading.current_thread() is threading.main_thread()
    rng = random.Random(label)
    interrupted = 0
    for n in range(24):
        timer = threading.Timer(rng.uniform(0.0, 0.08), os.kill, (os.getpid(), signal.SIGTERM))
        try:
            timer.start()
            with OwnedContainers(engine) as owned:
                owned.create(_spec(label, 2 * n))
                owned.create(_spec(label, 2 * n + 1))
                timer.join()  # the signal always arrives inside this block or before it
        except Interrupted:
            interrupted += 1
        finally:
            timer.join()
        assert not _mine(engine, label), f"round {n} left a container behind"
    assert interrupted == 24, "every round was interrupted (the check above saw real signals)"


def test_run_once_returns_the_output_and_removes_its_container(engine: DockerClient) -> None:
    label = uuid.uuid4().hex[:10]
    spec = _spec(label, 0).model_copy(update={"command": ["sh", "-c", "echo hello; exit 3"]})
    code, output = containers.run_once(engine, spec, timeout_s=60)
    assert (code, output.strip()) == (3, "hello")
    assert not _mine(engine, label)
