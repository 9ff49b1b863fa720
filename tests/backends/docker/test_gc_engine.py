"""`sandbox gc` on a shared engine: two collectors at once over the same orphans."""

from __future__ import annotations

import contextlib
import threading
import uuid

import docker.errors
import pytest
from docker import DockerClient

from sandbox.backends.docker.gc import GcReport, collect
from sandbox.contracts.names import (
    LABEL_MANAGED,
    LABEL_RUNNER_PID,
    LABEL_RUNNER_START,
    STEP_IMAGE,
)

pytestmark = pytest.mark.engine

ORPHANS = 6
COLLECTORS = 3


def _dead_pid() -> int:
    """A pid no process has (the kernel's pid_max is far below it)."""
    return 2**22 + 1


def test_collectors_racing_over_the_same_orphans_all_end_and_remove_them(
    engine: DockerClient,
) -> None:
    """A removal another collector (or a dying runner) already has in progress is waited
    for, not an error: every `sandbox gc` ends, and every orphan is gone."""
    tag = uuid.uuid4().hex[:8]
    labels = {
        LABEL_MANAGED: "1",
        LABEL_RUNNER_PID: str(_dead_pid()),
        LABEL_RUNNER_START: "1.0",
    }
    names = [f"sandbox-gc-race-{tag}-{i}" for i in range(ORPHANS)]
    for name in names:
        engine.containers.run(
            STEP_IMAGE,
            ["sleep", "300"],
            name=name,
            labels=labels,
            detach=True,
            network_mode="none",
        )
    reports: list[GcReport] = []
    errors: list[BaseException] = []
    start = threading.Barrier(COLLECTORS)

    def gc() -> None:
        start.wait()
        try:
            reports.append(collect(engine))
        except BaseException as exc:  # what the CLI would print as an internal error
            errors.append(exc)

    threads = [threading.Thread(target=gc) for _ in range(COLLECTORS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        removed = {n for report in reports for n in report.containers_removed}
        assert set(names) <= removed
        for name in names:
            with pytest.raises(docker.errors.NotFound):
                engine.containers.get(name)
    finally:
        for name in names:
            with contextlib.suppress(docker.errors.NotFound):
                engine.containers.get(name).remove(force=True)
