"""Which memory figure a record trusts, per step runtime (pure: no engine)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from sandbox.collect.stepreports import resources
from sandbox.contracts.record import PeakMemorySource
from sandbox.stepside.agentworks_exec.interface import USAGE_MARK

MIB = 1 << 20


@dataclass
class EngineFigures:
    peak_memory_bytes: int | None
    peak_memory_source: PeakMemorySource | None
    cpu_seconds: float | None = None

    def finish(self) -> None:
        return None


def _report(**figures: float) -> str:
    return f"step output\n{USAGE_MARK} {json.dumps(figures)}\n"


def test_under_runc_the_containers_own_cgroup_peak_counts() -> None:
    engine = EngineFigures(40 * MIB, "engine_stats")
    stderr = _report(cpu_seconds=0.5, max_rss_bytes=60 * MIB, cgroup_peak_bytes=70 * MIB)
    got = resources(engine, stderr, executor_sees_memory=True)
    assert (got.peak_memory_bytes, got.peak_memory_source) == (70 * MIB, "container_cgroup")
    assert got.cpu_seconds == 0.5


def test_under_gvisor_the_executors_figures_never_set_the_peak() -> None:
    """The sentry's rusage is about processes the step controls: a claim of 4 GiB (or of
    nothing) leaves the host's figure as it is."""
    engine = EngineFigures(90 * MIB, "host_cgroup")
    for claimed in (4096 * MIB, 0):
        stderr = _report(cpu_seconds=0.5, max_rss_bytes=claimed, cgroup_peak_bytes=claimed)
        got = resources(engine, stderr, executor_sees_memory=False)
        assert (got.peak_memory_bytes, got.peak_memory_source) == (90 * MIB, "host_cgroup")


def test_no_figure_names_no_source() -> None:
    got = resources(EngineFigures(None, None), "no report\n", executor_sees_memory=False)
    assert (got.peak_memory_bytes, got.peak_memory_source) == (None, None)
