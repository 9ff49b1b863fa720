"""The preflight and the disk quota, against the real engine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.contracts.record import RunStatus
from sandbox.contracts.testknobs import weakened_for_tests
from sandbox.run.testrun import RunOptions, TestRun
from sandbox.stepside.agentworks_exec import preflight
from tests.conftest import WorkflowFactory, tree_digest
from tests.fakes.harness import Outside, outside_server


@pytest.fixture
def outside(engine: DockerClient) -> Iterator[Outside]:
    with outside_server(engine) as server:
        yield server


def test_preflight_fails_where_a_way_out_is_open() -> None:
    """On the host, as root, raw sockets open: the checks can fail, and say so."""
    if os.geteuid() != 0:
        pytest.skip("raw sockets need root on the host")
    result = preflight.run({})
    assert result["ok"] is False
    assert any(item.startswith("raw socket") for item in result["open"])


@pytest.mark.engine
def test_preflight_passes_in_a_closed_namespace(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    wf = make_workflow(command="echo ran > ran.txt", db_sql=None)
    options = RunOptions(
        upstream_networks=(outside.network,),
        canary=f"{outside.ipv4}:8080",
        canary6=f"[{outside.ipv6}]:8080",
    )
    record = TestRun(wf, "step1", options).execute()
    assert record.status is RunStatus.PASSED, record.reason
    check = record.preflight
    assert check is not None and check.ok and check.firewall_verified and check.open == []
    # Its duration is recorded (the bench's start-up breakdown judges it, not this test).
    assert check.ms is not None and check.ms >= 0
    assert f"TCP to the canary {outside.ipv4}:8080" in check.checks
    assert f"TCP to the canary [{outside.ipv6}]:8080" in check.checks
    assert outside.seen() == []


@pytest.mark.engine
def test_open_namespace_stops_the_step_before_it_starts(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    wf = make_workflow(command="echo ran > ran.txt", db_sql=None)
    before = tree_digest(wf)
    options = RunOptions(upstream_networks=(outside.network,), canary=f"{outside.ipv4}:8080")
    with weakened_for_tests(install_firewall=False):  # prove the preflight sees the hole
        record = TestRun(wf, "step1", options).execute()
    assert record.status is RunStatus.ERROR
    assert "preflight found a way out open" in record.reason
    assert f"TCP to the canary {outside.ipv4}:8080" in record.reason
    assert not (Path(record.workflow_dir) / "runs" / record.id / "g" / "ran.txt").exists()
    assert tree_digest(wf) == before


@pytest.mark.engine
def test_disk_quota_stops_the_step(engine: DockerClient, make_workflow: WorkflowFactory) -> None:
    source = (
        "import os\n"
        "block = os.urandom(1 << 20)\n"
        "with open('fill.bin', 'wb') as f:\n"
        "    for _ in range(2000):\n"
        "        f.write(block); f.flush()\n"
        "print('wrote everything')\n"
    )
    wf = make_workflow(
        command=["python3", "/workflow/code/fill.py"],
        extra_toml="[limits]\ndisk_quota_mb = 20\n",
        db_sql=None,
    )
    (wf / "code" / "fill.py").write_text(source)
    record = TestRun(wf, "step1").execute()
    assert record.status is RunStatus.QUOTA
    assert "disk quota of 20 MB" in record.reason
    assert "wrote everything" not in record.stdout.text
    assert record.disk_used_bytes is not None
    # The kernel holds the wall: the step's disk never holds more than the quota.
    assert 18 * 1024**2 < record.disk_used_bytes <= 20 * 1024**2
