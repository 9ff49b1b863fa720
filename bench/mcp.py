"""MCP: a read-only MCP call through the guard vs the same server spoken to over
stdio directly."""

from __future__ import annotations

import json

from bench.common import (
    MCP_HTTP_CLIENT,
    MCP_STDIO_CLIENT,
    Bench,
    BenchError,
    held_run,
    hold_workflow,
)
from bench.results import Goal, LatencyStats, McpDetail, Row, make_row
from sandbox.contracts.layout import GUARD_UID, STEP_UID
from sandbox.contracts.names import MCP_IMAGE
from sandbox.contracts.record import RunStatus
from sandbox.guard.config import BRIDGE_PORT, MCP_PATH
from sandbox.launch.specs import MCP_SERVER_PATH
from sandbox.run.testrun import TestRun

MCP_SERVER = ["mcp-server-time", "--local-timezone", "UTC"]  # installed in the MCP image


MCP_TOOL = ("get_current_time", {"timezone": "UTC"})  # annotated readOnlyHint: forwarded


MCP_VERSION = "2025-06-18"


def bench_mcp(b: Bench) -> list[Row]:
    s = b.sizes
    goal = Goal(kind="added_max", threshold=None, text="<= tools/list + 1 ms added")
    detail = McpDetail(server=" ".join(MCP_SERVER), tool=MCP_TOOL[0])
    b.results.mcp = detail
    toml = f'[[mcp_servers]]\nname = "time"\ncommand = {json.dumps(MCP_SERVER)}\n'
    wf = hold_workflow(b, "mcp", 0, toml)
    guarded_us: list[int] = []
    list_us: list[int] = []
    direct_us: list[int] = []
    with held_run(b, TestRun(wf, "hold")) as held:
        through = {
            "port": BRIDGE_PORT,
            "path": f"{MCP_PATH}/time",
            "token": held.token,
            "version": MCP_VERSION,
            "tool": MCP_TOOL[0],
            "arguments": MCP_TOOL[1],
            "n": s.mcp_n,
            "warmup": 20,
        }
        # The PATH a stdio server gets (the MCP image's servers first).
        server_path = MCP_SERVER_PATH
        direct = {**through, "command": MCP_SERVER, "server_path": server_path}
        for r in range(s.mcp_rounds):
            for which in ("guarded", "direct") if r % 2 == 0 else ("direct", "guarded"):
                if which == "guarded":
                    out = b.helper(
                        netns_of=held.guard_id, user=STEP_UID, script=MCP_HTTP_CLIENT, cfg=through
                    )
                    guarded_us += out["call_us"]
                else:
                    out = b.helper(
                        netns_of=None,
                        user=GUARD_UID,
                        script=MCP_STDIO_CLIENT,
                        cfg=direct,
                        image=MCP_IMAGE,
                    )
                    list_us += out["list_us"]
                    direct_us += out["call_us"]
            b.say(f"mcp: round {r + 1}/{s.mcp_rounds}")
    record = held.record
    if record is None or record.status is not RunStatus.PASSED:
        why = "no record" if record is None else f"{record.status.value}: {record.reason}"
        raise BenchError(f"mcp bench run did not pass: {why}")
    detail.guarded = LatencyStats.from_us(guarded_us)
    detail.direct_call = LatencyStats.from_us(direct_us)
    detail.direct_list = LatencyStats.from_us(list_us)
    floor = detail.direct_list.median_ms + 1.0
    added = detail.guarded.median_ms - detail.direct_call.median_ms
    b.note(
        f"mcp: {detail.tool} of `{detail.server}` (readOnlyHint, so forwarded) through the guard's"
        f" streamable-HTTP endpoint from the run's namespace as the step's uid, one keep-alive"
        f" connection, vs the same server spoken to over stdio directly in an MCP-image"
        f" container (the guard reaches it over its relay's socket); its own tools/list takes"
        f" {detail.direct_list.median_ms:.2f} ms (median), so the goal allows"
        f" {floor:.2f} ms added"
    )
    return [
        make_row(
            "mcp_latency",
            "mcp: read-only call, median",
            "ms",
            detail.guarded.median_ms,
            detail.direct_call.median_ms,
            goal.model_copy(update={"threshold": floor}),
            baseline_name="direct stdio",
            note=f"added {added:.2f} ms; allowed {floor:.2f} ms",
        )
    ]
