"""MCP: a read-only MCP call through the guard vs mcp-proxy relaying the same server, and
vs the same server spoken to over stdio directly; the official SDK's client every time."""

from __future__ import annotations

import json
from typing import Any

from bench import mcp_peer
from bench.common import MCP_SDK_CLIENT, Bench, BenchError, held_run, hold_workflow
from bench.results import Goal, LatencyStats, McpDetail, Row, make_row
from sandbox.contracts.guardconfig import BRIDGE_PORT, MCP_PATH
from sandbox.contracts.layout import GUARD_UID, STEP_UID
from sandbox.contracts.names import MCP_IMAGE
from sandbox.contracts.record import RunStatus
from sandbox.launch.specs import MCP_SERVER_PATH
from sandbox.run.testrun import TestRun

MCP_SERVER = ["mcp-server-time", "--local-timezone", "UTC"]  # installed in the MCP image


MCP_TOOL = ("get_current_time", {"timezone": "UTC"})  # annotated readOnlyHint: forwarded


# The handshake era on every side: mcp-proxy's 1.x SDK speaks nothing newer, so all three
# targets are timed on the same protocol.
MCP_MODE = "legacy"
SDK_PYTHON = "/opt/mcp/py/bin/python"  # the MCP image's venv: the SDK 2.x


TARGETS = ("guarded", "mcp-proxy", "direct")


def _configs(token: str, n: int) -> dict[str, dict[str, Any]]:
    """Each target's client config (mcp_sdk_client.py): same tool, same loop."""
    common = {"mode": MCP_MODE, "tool": MCP_TOOL[0], "arguments": MCP_TOOL[1], "n": n}
    common["warmup"] = 20
    return {
        "guarded": {
            **common,
            "transport": "http",
            "url": f"http://127.0.0.1:{BRIDGE_PORT}{MCP_PATH}/time",
            "token": token,
        },
        "mcp-proxy": {
            **common,
            "transport": "http",
            "url": f"http://127.0.0.1:{mcp_peer.MCP_PROXY_PORT}/mcp",
            "wait_s": 60,
        },
        "direct": {
            **common,
            "transport": "stdio",
            "command": MCP_SERVER,
            "server_path": MCP_SERVER_PATH,  # the PATH a stdio server gets
            "time_list": True,
        },
    }


def bench_mcp(b: Bench) -> list[Row]:
    s = b.sizes
    detail = McpDetail(server=" ".join(MCP_SERVER), tool=MCP_TOOL[0], client="mcp SDK Client")
    b.results.mcp = detail
    toml = f'[[mcp_servers]]\nname = "time"\ncommand = {json.dumps(MCP_SERVER)}\n'
    wf = hold_workflow(b, "mcp", 0, toml)
    samples: dict[str, list[int]] = {t: [] for t in TARGETS}
    list_us: list[int] = []
    with held_run(b, TestRun(wf, "hold")) as held, mcp_peer.running(b, MCP_SERVER) as peer:
        cfgs = _configs(held.token, s.mcp_n)
        netns = {"guarded": held.guard_id, "mcp-proxy": peer, "direct": None}
        user = {"guarded": STEP_UID, "mcp-proxy": GUARD_UID, "direct": GUARD_UID}
        for r in range(s.mcp_rounds):
            order = TARGETS[r % 3 :] + TARGETS[: r % 3]  # each target first once in 3 rounds
            for which in order:
                out = b.helper(
                    netns_of=netns[which],
                    user=user[which],
                    script=MCP_SDK_CLIENT,
                    cfg=cfgs[which],
                    image=mcp_peer.MCP_PROXY_IMAGE if which == "mcp-proxy" else MCP_IMAGE,
                    python=SDK_PYTHON,
                )
                samples[which] += out["call_us"]
                list_us += out["list_us"]
                detail.protocol[which] = str(out.get("protocol"))
            b.say(f"mcp: round {r + 1}/{s.mcp_rounds}")
    record = held.record
    if record is None or record.status is not RunStatus.PASSED:
        why = "no record" if record is None else f"{record.status.value}: {record.reason}"
        raise BenchError(f"mcp bench run did not pass: {why}")
    detail.guarded = LatencyStats.from_us(samples["guarded"])
    detail.mcp_proxy = LatencyStats.from_us(samples["mcp-proxy"])
    detail.direct_call = LatencyStats.from_us(samples["direct"])
    detail.direct_list = LatencyStats.from_us(list_us)
    floor = detail.direct_list.median_ms + 1.0
    added = detail.guarded.median_ms - detail.direct_call.median_ms
    b.note(
        f"mcp: {detail.tool} of `{detail.server}` (readOnlyHint, so forwarded), timed with the"
        f" official mcp SDK's Client ({MCP_MODE} handshake, tools listed once, then one"
        " tools/call at a time) from a container of the MCP image: through the guard's"
        " streamable-HTTP endpoint from the run's namespace as the step's uid (the guard"
        " reaches the server in its own container over its relay's socket, and asks it for"
        f" tools/list before every call); through {mcp_peer.MCP_PROXY_REQUIREMENT}'s"
        " streamable-HTTP endpoint from its container's namespace (the server is its child"
        " over stdio; no lookup, no log); and over stdio straight to the server. The"
        f" server's own tools/list takes {detail.direct_list.median_ms:.2f} ms (median), so"
        f" the direct goal allows {floor:.2f} ms added"
    )
    return [
        make_row(
            "mcp_vs_proxy",
            "mcp: read call, SDK client, vs mcp-proxy",
            "ms",
            detail.guarded.median_ms,
            detail.mcp_proxy.median_ms,
            Goal(kind="ratio_max", threshold=1.0, text="<= 1.0x (with the live lookup)"),
            baseline_name="mcp-proxy",
        ),
        make_row(
            "mcp_latency",
            "mcp: read call, SDK client, median",
            "ms",
            detail.guarded.median_ms,
            detail.direct_call.median_ms,
            Goal(kind="added_max", threshold=floor, text="<= tools/list + 1 ms added"),
            baseline_name="direct stdio",
            note=f"added {added:.2f} ms; allowed {floor:.2f} ms",
        ),
    ]
