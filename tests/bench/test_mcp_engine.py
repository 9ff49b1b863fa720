"""The bench's MCP benchmark end to end, against the real engine (no timing asserted:
speed targets live in `make bench`): the official SDK client reaches a held test run's
guard with the run's token, mcp-proxy (built by the bench itself) and the server over
stdio, and the same server behind mcp-proxy as a streamable-HTTP server the workflow
names by its URL, through the guard and straight; every call through the guard is a
forwarded, logged one."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from docker import DockerClient

from bench.common import QUICK, Bench
from bench.harness import host_info, scratch_dir
from bench.mcp import MCP_TOOL, bench_mcp
from bench.results import BenchResults
from sandbox.contracts.wire import ActionLine

pytestmark = pytest.mark.engine


@pytest.fixture
def bench(engine: DockerClient) -> Iterator[Bench]:
    results = BenchResults(started_at=datetime.now(UTC), host=host_info(engine))
    with scratch_dir() as work:
        b = Bench(engine, work, QUICK.model_copy(update={"mcp_n": 3, "mcp_rounds": 1}), results)
        try:
            yield b
        finally:
            b.cleanup()


def test_sdk_client_reaches_the_guard_mcp_proxy_and_the_server(bench: Bench) -> None:
    rows = bench_mcp(bench)

    by_key = {row.key: row for row in rows}
    assert set(by_key) == {"mcp_vs_proxy", "mcp_latency", "mcp_http"}
    for row in rows:
        assert row.status == "measured" and row.ours is not None and row.baseline is not None
    assert by_key["mcp_vs_proxy"].baseline_name == "mcp-proxy"
    assert by_key["mcp_http"].baseline_name == "the server, straight"
    detail = bench.results.mcp
    assert detail is not None and detail.client == "mcp SDK Client"
    for stats in (
        detail.guarded,
        detail.mcp_proxy,
        detail.direct_call,
        detail.guarded_http,
        detail.http_direct,
    ):
        assert stats is not None and stats.n == 3
    assert set(detail.protocol) == {"guarded", "mcp-proxy", "direct", "guarded-http", "http-direct"}
    # Each guarded call was forwarded and logged: a start and an outcome line, 20 warm-up
    # calls and 3 timed ones.
    actions = next(Path(bench.work, "mcp", "runs").glob("test-*/test_mode_actions.jsonl"))
    lines = [ActionLine.model_validate_json(x) for x in actions.read_text().splitlines()]
    tool = f"mcp:time/{MCP_TOOL[0]}"
    starts = [x for x in lines if x.tool == tool and x.event == "start"]
    outcomes = [x for x in lines if x.tool == tool and x.event == "outcome"]
    assert len(starts) == len(outcomes) == 23
    assert all(x.decision == "allow" for x in starts)
    assert all(x.outcome == "ok" for x in outcomes)
    # ...and so was each call to the HTTP server.
    tool = f"mcp:timehttp/{MCP_TOOL[0]}"
    starts = [x for x in lines if x.tool == tool and x.event == "start"]
    outcomes = [x for x in lines if x.tool == tool and x.event == "outcome"]
    assert len(starts) == len(outcomes) == 23
    assert all(x.decision == "allow" for x in starts)
    assert all(x.outcome == "ok" for x in outcomes)
