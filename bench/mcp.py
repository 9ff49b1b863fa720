"""MCP: a read-only MCP call through the guard vs mcp-proxy relaying the same server, and
vs the same server spoken to over stdio directly; and the same call to a streamable-HTTP
server (mcp-proxy on a network of the bench's, named by the workflow's `url`) through the
guard vs straight to that server from the guard's namespace. The official SDK's client
every time."""

from __future__ import annotations

import json
from typing import Any

from bench import mcp_peer
from bench.common import (
    MCP_SDK_CLIENT,
    Bench,
    BenchError,
    address_on,
    bench_network,
    held_run,
    hold_workflow,
)
from bench.results import Goal, LatencyStats, McpDetail, Row, make_row
from sandbox.contracts.guardconfig import BRIDGE_PORT, MCP_PATH
from sandbox.contracts.layout import GUARD_UID, STEP_UID
from sandbox.contracts.names import MCP_IMAGE
from sandbox.contracts.record import RunStatus
from sandbox.launch.specs import MCP_SERVER_PATH
from sandbox.run.testrun import RunOptions, TestRun

MCP_SERVER = ["mcp-server-time", "--local-timezone", "UTC"]  # installed in the MCP image


MCP_TOOL = ("get_current_time", {"timezone": "UTC"})  # annotated readOnlyHint: forwarded


# The handshake era on every side: mcp-proxy's 1.x SDK speaks nothing newer, so all three
# targets are timed on the same protocol.
MCP_MODE = "legacy"
SDK_PYTHON = "/opt/mcp/py/bin/python"  # the MCP image's venv: the SDK 2.x


# "guarded-http" / "http-direct": the HTTP server through the guard (the step's uid) / from
# the guard's namespace as the guard's uid (the only one the firewall lets out), straight.
TARGETS = ("guarded", "mcp-proxy", "direct", "guarded-http", "http-direct")
HTTP_SERVER = "timehttp"  # the workflow's name for the streamable-HTTP server


def _configs(token: str, n: int, http_url: str) -> dict[str, dict[str, Any]]:
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
        "guarded-http": {
            **common,
            "transport": "http",
            "url": f"http://127.0.0.1:{BRIDGE_PORT}{MCP_PATH}/{HTTP_SERVER}",
            "token": token,
        },
        "http-direct": {**common, "transport": "http", "url": http_url, "wait_s": 60},
    }


def _rounds(
    b: Bench,
    token: str,
    guard_id: str,
    peer: str,
    http_url: str,
    samples: dict[str, list[int]],
    list_us: list[int],
    detail: McpDetail,
) -> None:
    """Every target once a round, the first rotating (each first once in five rounds)."""
    s = b.sizes
    cfgs = _configs(token, s.mcp_n, http_url)
    netns = {"guarded": guard_id, "mcp-proxy": peer, "direct": None}
    netns |= {"guarded-http": guard_id, "http-direct": guard_id}
    user = {"guarded": STEP_UID, "mcp-proxy": GUARD_UID, "direct": GUARD_UID}
    user |= {"guarded-http": STEP_UID, "http-direct": GUARD_UID}
    for r in range(s.mcp_rounds):
        k = r % len(TARGETS)
        for which in TARGETS[k:] + TARGETS[:k]:
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


def bench_mcp(b: Bench) -> list[Row]:
    detail = McpDetail(server=" ".join(MCP_SERVER), tool=MCP_TOOL[0], client="mcp SDK Client")
    b.results.mcp = detail
    samples: dict[str, list[int]] = {t: [] for t in TARGETS}
    list_us: list[int] = []
    with (
        bench_network(b) as network,
        mcp_peer.running(b, MCP_SERVER, network=network) as http_peer,
        mcp_peer.running(b, MCP_SERVER) as peer,
    ):
        address = address_on(b, http_peer, network)
        http_url = f"http://{address}:{mcp_peer.MCP_PROXY_PORT}/mcp"
        toml = (
            f'[[mcp_servers]]\nname = "time"\ncommand = {json.dumps(MCP_SERVER)}\n\n'
            f'[[mcp_servers]]\nname = "{HTTP_SERVER}"\nurl = "{http_url}"\n'
        )
        wf = hold_workflow(b, "mcp", 0, toml)
        run = TestRun(wf, "hold", RunOptions(upstream_networks=(network,)))
        with held_run(b, run) as held:
            _rounds(b, held.token, held.guard_id, peer, http_url, samples, list_us, detail)
    record = held.record
    if record is None or record.status is not RunStatus.PASSED:
        why = "no record" if record is None else f"{record.status.value}: {record.reason}"
        raise BenchError(f"mcp bench run did not pass: {why}")
    detail.guarded = LatencyStats.from_us(samples["guarded"])
    detail.mcp_proxy = LatencyStats.from_us(samples["mcp-proxy"])
    detail.direct_call = LatencyStats.from_us(samples["direct"])
    detail.direct_list = LatencyStats.from_us(list_us)
    detail.guarded_http = LatencyStats.from_us(samples["guarded-http"])
    detail.http_direct = LatencyStats.from_us(samples["http-direct"])
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
        f" the direct goal allows {floor:.2f} ms added. The HTTP server: the same server"
        f" behind {mcp_peer.MCP_PROXY_REQUIREMENT} on a network of the bench's, named by the"
        " workflow's `url`; through the guard as above, and straight to its address from the"
        " run's namespace as the guard's uid"
    )
    return [
        make_row(
            "mcp_vs_proxy",
            "mcp: read call, SDK client, vs mcp-proxy",
            "ms",
            detail.guarded.median_ms,
            detail.mcp_proxy.median_ms,
            Goal(kind="ratio_max", threshold=0.8, text="<= 0.8x (with the live lookup)"),
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
        make_row(
            "mcp_http",
            "mcp: read call to an HTTP server, SDK client, vs the server direct",
            "ms",
            detail.guarded_http.median_ms,
            detail.http_direct.median_ms,
            baseline_name="the server, straight",
            note=f"added {detail.guarded_http.median_ms - detail.http_direct.median_ms:.2f} ms;"
            f" p99 {detail.guarded_http.p99_ms:.2f} ms vs {detail.http_direct.p99_ms:.2f}; the"
            " guard asks the server for tools/list before every call, a second round trip to"
            " it over the network",
        ),
    ]
