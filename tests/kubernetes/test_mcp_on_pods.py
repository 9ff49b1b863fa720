"""Stdio MCP servers as containers of the run's Pod, on the real local cluster.

The servers are the Docker suite's hostile server (`tests/fakes/hostile_mcp.py`): one
with an egress list naming the fake outside server Pod (`fetcher`, index 0, its
relay on port 3128), one without (`sealed`, index 1, no relay port). A Pod's
containers share one network namespace, so what keeps them apart is the init
container's per-uid firewall (`sandbox.launch.firewall.PodPeers`): this checks it
from each side, and that the runner fails closed when the read-back is not the
rules it expects.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest

from sandbox.backends import BackendFactory
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.contracts.wire import ActionLine
from sandbox.hostfs import hostmount
from sandbox.launch import firewall
from sandbox.launch import specs as launch
from sandbox.run.testrun import TestRun
from tests.conftest import call_lines, write_workflow
from tests.kubernetes.pods import (
    OUTSIDE_PORT,
    no_pods_or_secrets,
    outside_server_pod,
    start_server,
)

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

HOSTILE = Path(__file__).resolve().parents[1] / "fakes" / "hostile_mcp.py"
FETCHER_PORT, SEALED_PORT = 3128, 3129  # layout.mcp_proxy_port(0) and (1)

SERVERS = """
[[mcp_servers]]
name = "fetcher"
command = ["python3", "/workflow/code/hostile_mcp.py"]
env = { HOSTILE_NAME = "fetcher", HOSTILE_OTHER = "sealed" }
egress = [{ host = "OUTSIDE", port = PORT }]

[[mcp_servers]]
name = "sealed"
command = ["python3", "/workflow/code/hostile_mcp.py"]
env = { HOSTILE_NAME = "sealed", HOSTILE_OTHER = "fetcher" }
"""

STEP = """
import json, os, socket
import agentworks_mcp as mcp

def tcp(host, port):
    try:
        socket.create_connection((host, port), timeout=5).close()
        return "connected"
    except OSError as exc:
        return type(exc).__name__

page = "http://OUTSIDE:PORT/"
out = {}
with mcp.connect("fetcher") as fetcher, mcp.connect("sealed") as sealed:
    out["echo"] = fetcher.call_tool("echo", {"a": 1})
    out["fetcher"] = fetcher.call_tool("fetch", {"url": page, "direct": "OUTSIDE:PORT"})
    out["sealed"] = sealed.call_tool("fetch", {"url": page, "direct": "127.0.0.1:3128"})
    out["attack"] = sealed.call_tool("attack", {"run_id": os.environ["AGENTWORKS_TEST_RUN_ID"]})
out["step_to_relays"] = {str(p): tcp("127.0.0.1", p) for p in (3128, 3129)}
out["step_direct"] = tcp("OUTSIDE", PORT)
json.dump(out, open("out.json", "w"))
"""


def _text(result: dict[str, Any]) -> str:
    return "\n".join(b.get("text", "") for b in result.get("content", []) if "text" in b)


def _workflow(node_dir: Path, outside_ip: str) -> Path:
    def fill(text: str) -> str:
        return text.replace("OUTSIDE", outside_ip).replace("PORT", str(OUTSIDE_PORT))

    wf = write_workflow(
        node_dir, command=["python3", "/workflow/code/step.py"], extra_toml=fill(SERVERS)
    )
    (wf / "code" / "step.py").write_text(fill(textwrap.dedent(STEP)))
    shutil.copy(HOSTILE, wf / "code" / "hostile_mcp.py")
    return wf


def _lines(record: TestRunRecord) -> list[ActionLine]:
    path = Path(record.workflow_dir) / "runs" / record.id / "test_mode_actions.jsonl"
    return [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]


def test_stdio_servers_on_a_pod_answer_through_the_guard_and_reach_nothing_else(
    kube_core: Any, kube_namespace: str, pods: BackendFactory, node_dir: Path, mcp_image: None
) -> None:
    outside_ip = start_server(kube_core, kube_namespace, outside_server_pod())
    wf = _workflow(node_dir, outside_ip)
    record = TestRun(wf, "step1", backend=pods).execute()

    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    assert record.backend == "kubernetes"
    out = json.loads((wf / "runs" / record.id / "g" / "out.json").read_text())
    assert json.loads(_text(out["echo"])) == {"a": 1}
    # The fetcher's only way out is its relay to the guard's egress proxy, its own list.
    fetched = json.loads(_text(out["fetcher"]))
    assert fetched["proxy"] == f"http://127.0.0.1:{FETCHER_PORT}"
    assert fetched["http"][0] == 200, fetched
    assert "ConnectionRefusedError" in fetched["direct"], fetched  # never straight out
    # The sealed server: no way out, not even through the other server's relay port.
    sealed = json.loads(_text(out["sealed"]))
    assert sealed["proxy"] == "" and not isinstance(sealed["http"], list), sealed
    assert "ConnectionRefusedError" in sealed["direct"], sealed
    report = json.loads(_text(out["attack"]))
    assert report["uid"] == 10101
    assert all("ConnectionRefusedError" in v for v in report["loopback"].values()), report
    assert "ConnectionRefusedError" in report["exec_call"], report["exec_call"]
    assert all(not v.startswith("ok") for v in report["other_socket"].values()), report
    assert all(not v.startswith("ok") for v in report["read_files"].values()), report
    # The step reaches neither server's relay port, nor the outside server.
    assert out["step_to_relays"] == {
        str(FETCHER_PORT): "ConnectionRefusedError",
        str(SEALED_PORT): "ConnectionRefusedError",
    }
    # The step's direct connection lands on the guard (transparent egress), which
    # refuses it there: it never reaches the outside server.
    assert out["step_direct"] == "connected"
    # Every call the guard forwarded is in the action log, and the fetcher's egress too.
    lines = _lines(record)
    calls = [
        (ln.tool, ln.decision) for ln in lines if ln.category == "mcp" and ln.event != "outcome"
    ]
    assert calls == [
        ("mcp:fetcher/echo", "allow"),
        ("mcp:fetcher/fetch", "allow"),
        ("mcp:sealed/fetch", "allow"),
        ("mcp:sealed/attack", "allow"),
    ], calls
    actions = Path(record.workflow_dir) / "runs" / record.id / "test_mode_actions.jsonl"
    every = [ln for ln in call_lines(actions) if ln.tool == "http"]  # its start lines
    direct = [ln for ln in every if ln.detail.get("via") == "direct"]
    assert [(ln.decision, ln.arguments.get("method")) for ln in direct] == [("refuse", "TCP")]
    http = [ln for ln in every if ln.detail.get("via") != "direct"]
    assert [(ln.decision, ln.detail.get("mcp_server")) for ln in http] == [("allow", "fetcher")]
    assert set(record.mcp_servers) == {"fetcher", "sealed"}
    assert record.mcp_servers["fetcher"].uid == 10100
    assert record.mcp_servers["fetcher"].stderr_file
    no_pods_or_secrets(kube_core, kube_namespace)
    assert not hostmount.mounts_below(wf)


def test_a_firewall_that_reads_back_other_rules_fails_the_run_closed(
    kube_core: Any,
    kube_namespace: str,
    pods: BackendFactory,
    node_dir: Path,
    mcp_image: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runner expects the rules of the peers its plan names: a Pod whose firewall
    reads back without one server's rules (here: the runner expects a peer more) is
    never let run, and nothing of it is left."""
    real = launch.pod_peers

    def one_more(plan: launch.RunPlan) -> firewall.PodPeers | None:
        peers = real(plan)
        assert peers is not None
        return firewall.PodPeers(peers.step_uid, peers.guard_ports, (*peers.servers, (10199, 3199)))

    monkeypatch.setattr(launch, "pod_peers", one_more)
    wf = _workflow(node_dir, "10.0.0.1")
    record = TestRun(wf, "step1", backend=pods).execute()
    assert record.status is RunStatus.ERROR, (record.status, record.reason)
    assert "firewall reads back wrong" in (record.reason or ""), record.reason
    assert not (wf / "runs" / record.id / "g" / "out.json").exists()
    no_pods_or_secrets(kube_core, kube_namespace)
    assert not hostmount.mounts_below(wf)
