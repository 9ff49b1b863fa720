"""Stdio MCP servers are third-party code: a hostile one reaches nothing, and the record
stays true (real engine, a real hostile server process: `tests/fakes/hostile_mcp.py`).

The hostile server runs beside a second copy of itself (`other`, which holds a
credential from the runner's environment); it tries every attack it knows and
reports what each attempt got into its tool result, which the step writes down.
"""

from __future__ import annotations

import json
import secrets
import shutil
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from docker import DockerClient
from docker.models.containers import Container

from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.contracts.wire import ActionLine
from sandbox.run.testrun import RunOptions, TestRun
from tests import paths
from tests.conftest import ThreadedRun, WorkflowFactory, call_lines
from tests.fakes.harness import outside_server

pytestmark = pytest.mark.engine

HOSTILE = paths.TESTS / "fakes" / "hostile_mcp.py"
GUARD_UID, STEP_UID = 10002, 10001


def _servers(secret_name: str = "") -> str:
    host_env = f'env_from_host = ["{secret_name}"]' if secret_name else ""
    return textwrap.dedent(
        f"""
        [[mcp_servers]]
        name = "hostile"
        command = ["python3", "/workflow/code/hostile_mcp.py"]
        env = {{ HOSTILE_NAME = "hostile", HOSTILE_OTHER = "other" }}

        [[mcp_servers]]
        name = "other"
        command = ["python3", "/workflow/code/hostile_mcp.py"]
        env = {{ HOSTILE_NAME = "other", HOSTILE_OTHER = "hostile" }}
        {host_env}
        """
    )


def _workflow(make_workflow: WorkflowFactory, step: str, toml: str) -> Path:
    wf = make_workflow(command=["python3", "/workflow/code/step.py"], extra_toml=toml)
    (wf / "code" / "step.py").write_text(textwrap.dedent(step))
    shutil.copy(HOSTILE, wf / "code" / "hostile_mcp.py")
    return wf


def _lines(record: TestRunRecord) -> list[ActionLine]:
    path = Path(record.workflow_dir) / "runs" / record.id / "test_mode_actions.jsonl"
    return [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]


def _text(result: dict[str, Any]) -> str:
    return "\n".join(b.get("text", "") for b in result.get("content", []) if "text" in b)


def _host_view(container: Container) -> tuple[int, int, str]:
    """(uid inside, the uid its main process has on the host, its OCI runtime)."""
    container.reload()
    inside = int(str(container.attrs["Config"]["User"]).split(":")[0])
    pid = int(container.attrs["State"]["Pid"])
    status = Path(f"/proc/{pid}/status").read_text()
    host = int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])
    return inside, host, str(container.attrs["HostConfig"].get("Runtime") or "")


ATTACK_STEP = """
import json, os, pathlib, time
import agentworks_mcp as mcp

out = {"bridge_token": os.environ["AGENTWORKS_BRIDGE_TOKEN"]}
pathlib.Path("ready").write_text("1")
deadline = time.monotonic() + 120
while not pathlib.Path("go").exists():
    assert time.monotonic() < deadline
    time.sleep(0.05)
with mcp.connect("hostile") as hostile, mcp.connect("other") as other:
    out["attack"] = hostile.call_tool("attack", {"run_id": os.environ["AGENTWORKS_TEST_RUN_ID"]})
    out["sneaky"] = hostile.call_tool("sneaky_write", {})
    out["echo"] = hostile.call_tool("echo", {"a": 1})
    out["other_echo"] = other.call_tool("echo", {"b": 2})
json.dump(out, open("out.json", "w"))
"""


def test_a_hostile_stdio_server_reaches_nothing_and_the_record_is_the_guards(
    engine: DockerClient, make_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "other-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("SANDBOX_TEST_OTHER_SECRET", secret)
    wf = _workflow(make_workflow, ATTACK_STEP, _servers("SANDBOX_TEST_OTHER_SECRET"))
    with ThreadedRun(wf) as run:
        ready = run.wait_for_in_group("ready")
        run_id = run.layout.run_id
        (step,) = engine.containers.list(
            filters={"label": ["sandbox.role=step", f"sandbox.run-id={run_id}"]}
        )
        step_env = dict(e.split("=", 1) for e in step.attrs["Config"]["Env"])
        exec_token = step_env["AGENTWORKS_EXEC_TOKEN"]
        servers = engine.containers.list(
            filters={"label": ["sandbox.role=mcp", f"sandbox.run-id={run_id}"]}
        )
        hosted = {s.labels["sandbox.mcp-server"]: _host_view(s) for s in servers}
        (ready.parent / "go").write_text("1")
    record = run.record
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    out = json.loads((wf / "runs" / record.id / "g" / "out.json").read_text())
    report = json.loads(_text(out["attack"]))
    bridge_token = out["bridge_token"]

    # Its own uid, neither the step's nor the guard's; on the host, that uid as the
    # engine maps it (under userns-remap: base + uid, like the step's and the guard's).
    assert report["uid"] not in (GUARD_UID, STEP_UID, 0), report["uid"]
    base = record.walls.host_uid_base or 0
    assert set(hosted) == {"hostile", "other"}, hosted
    for name, (uid, host_uid, runtime) in hosted.items():
        assert host_uid == base + uid, (name, uid, host_uid, record.walls)
        # A server stays on runc when the step is under gVisor (launch.runtime says why).
        assert runtime in ("", "runc"), (name, runtime)
    assert hosted["hostile"][0] == report["uid"]
    # No process of the guard, the step or the other server in sight: not their command
    # lines, environments or memory, and no signal reaches them.
    cmdlines = [p.get("cmdline", "") for p in report["processes"].values()]
    for foreign in ("sandbox.guard", "agentworks_exec", "tini", "step.py"):
        assert not [c for c in cmdlines if foreign in c], (foreign, cmdlines)
    assert report["guard_pids_seen"] == [] and report["signal_guard"] == []
    # Every pid it can signal is a thread of a process it sees (its own container's).
    own = {*report["processes"], str(report["pid"])}
    assert set(report["signalable"].values()) <= own, report["signalable"]
    loot = "\n".join(report["loot"])
    for value in (secret, bridge_token, exec_token):
        assert value not in loot
    assert secret not in json.dumps(report)
    # Nothing of the run's record can be written, nor the guard's folders, nor its socket;
    # its own run's folder (named, since the view lists none) is tried too.
    run_root = f"/workflow/runs/{record.id}"
    assert f"{run_root}/test_mode_actions.jsonl" in report["append_action_log"], report
    assert {f"{run_root}/guard", f"{run_root}/mcp", f"{run_root}/g"} <= set(report["write"])
    assert f"{run_root}/mcp-stderr/other.log" in report["read_files"], report
    assert all(not v.startswith("ok") for v in report["append_action_log"].values()), report
    assert all(not v.startswith("ok") for v in report["read_action_log"].values()), report
    writes = {k: v for k, v in report["write"].items() if k != "/tmp"}
    assert writes and all(not v.startswith("ok") for v in writes.values()), writes
    assert report["write"]["/tmp"].startswith("ok")  # its own small tmpfs
    assert all(not v.startswith("ok") for v in report["replace_socket"].values()), report
    # Another server's stderr and socket, the guard's config: unreadable.
    assert all(not v.startswith("ok") for v in report["read_files"].values()), report
    assert all(not v.startswith("ok") for v in report["other_socket"].values()), report
    # No network at all: loopback has no guard, bridge, egress proxy or executor.
    assert report["interfaces"] == ["lo"]
    assert all("ConnectionRefusedError" in v for v in report["loopback"].values()), report
    assert "ConnectionRefusedError" in report["exec_call"], report["exec_call"]
    assert not list((wf / "runs" / record.id / "g").glob("planted-by-*"))

    # The record holds exactly the lines the guard wrote.
    assert "TEST MODE: sneaky_write was NOT run" in _text(out["sneaky"])
    assert json.loads(_text(out["other_echo"])) == {"b": 2}
    log_text = (wf / "runs" / record.id / "test_mode_actions.jsonl").read_text()
    assert "forged-by-" not in log_text
    lines = [ln for ln in _lines(record) if ln.category == "mcp"]
    calls = [(ln.tool, ln.decision) for ln in lines if ln.event != "outcome"]
    # each forwarded call: its start line, then its outcome line
    starts = [ln.call_id for ln in lines if ln.event == "start"]
    assert starts == [ln.call_id for ln in lines if ln.event == "outcome"]
    events = ["start", "outcome", "call", "start", "outcome", "start", "outcome"]
    assert [ln.event for ln in lines] == events
    assert calls == [
        ("mcp:hostile/attack", "allow"),
        ("mcp:hostile/sneaky_write", "stub"),
        ("mcp:hostile/echo", "allow"),
        ("mcp:other/echo", "allow"),
    ]
    assert (record.actions.allow, record.actions.stub, record.actions.malformed) == (3, 1, 0)


FLOOD_STEP = """
import json, threading
import agentworks_mcp as mcp

out = {}
with mcp.connect("hostile") as hostile:
    out["flood"] = hostile.call_tool("flood", {"count": 60, "kb": 1024})
    out["big"] = hostile.call_tool("big", {"mb": 200})
    out["after"] = hostile.call_tool("echo", {"still": "alive"})

results = {}
def near_cap(n):
    with mcp.connect("hostile") as session:
        result = session.call_tool("big", {"mb": 7})
        results[n] = (result.get("isError"), len(json.dumps(result)))
threads = [threading.Thread(target=near_cap, args=(n,)) for n in range(8)]
for t in threads: t.start()
for t in threads: t.join()
out["near_cap"] = results
json.dump(out, open("out.json", "w"))
"""


def test_a_200_mb_result_and_reply_floods_leave_the_guard_alive(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = _workflow(make_workflow, FLOOD_STEP, _servers())
    record = TestRun(wf, "step1").execute()
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    out = json.loads((wf / "runs" / record.id / "g" / "out.json").read_text())
    assert _text(out["flood"]) == "flooded 60 x 1024 KB"
    big = out["big"]
    assert big["isError"] is True
    assert "larger than" in _text(big) and "MiB" in _text(big), _text(big)
    assert json.loads(_text(out["after"])) == {"still": "alive"}
    assert sorted(out["near_cap"].values()) == [[False, pytest.approx(7 * 2**20, rel=0.01)]] * 8
    lines = [ln for ln in _lines(record) if ln.tool == "mcp:hostile/big"]
    assert lines and all(ln.decision == "allow" for ln in lines)


SLOW_STEP = """
import agentworks_mcp as mcp
with mcp.connect("hostile") as hostile:
    hostile.call_tool("slow", {})
"""


def test_a_guard_killed_mid_call_leaves_the_call_started_with_no_outcome(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = _workflow(make_workflow, SLOW_STEP, _servers())
    with ThreadedRun(wf) as run:
        actions = run.wait_for_file("test-*/test_mode_actions.jsonl")
        deadline = time.monotonic() + 120
        while "mcp:hostile/slow" not in actions.read_text():
            assert time.monotonic() < deadline, "the slow call was never logged"
            assert not run.finished
            time.sleep(0.05)
        run.guard(engine, actions.parent.name).kill()  # SIGKILL, from the host
    record = run.record
    assert record.status is RunStatus.ERROR
    assert "guard stopped" in record.reason
    unknown = record.outcome_unknown
    assert [(u.tool, u.decision) for u in unknown] == [("mcp:hostile/slow", "allow")]
    assert record.actions.outcome_unknown == 1
    assert any("outcome unknown" in line for line in record.summary_lines())


EGRESS_STEP = """
import json
import agentworks_mcp as mcp

def fetch(session, **arguments):
    return json.loads(mcp.text_of(session.call_tool("fetch", arguments)))

out = {}
with mcp.connect("fetcher") as fetcher, mcp.connect("sealed") as sealed:
    out["get"] = fetch(fetcher, url="http://outside.test:8080/page", direct="OUTSIDE_V4:8080")
    out["post"] = fetch(fetcher, method="POST", url="http://outside.test:8080/effect")
    out["step_list"] = fetch(fetcher, url="http://outside.test:8081/only-the-steps")
    out["tls_get"] = fetch(fetcher, url="https://outside.test:8444/tls-page")
    out["tls_post"] = fetch(fetcher, method="POST", url="https://outside.test:8444/tls-effect")
    out["sealed"] = fetch(sealed, url="http://outside.test:8080/sealed", direct="OUTSIDE_V4:8080")
json.dump(out, open("out.json", "w"))
"""


def test_a_servers_only_way_out_is_the_guards_proxy_with_its_own_list(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    """A server with an `egress` list reaches what that list allows, read-only, through the
    guard (every line names it; its HTTPS inspected like the step's, with the run's CA in
    its trust); never the step's list; a server without one, nothing."""
    toml = textwrap.dedent(
        """
        [egress]
        allow = [{ host = "outside.test", port = 8081 }]
        trust_ca_files = ["outside-ca.pem"]

        [[mcp_servers]]
        name = "fetcher"
        command = ["python3", "/workflow/code/hostile_mcp.py"]
        egress = [
            { host = "outside.test", port = 8080 },
            { host = "outside.test", port = 8444, tls = true },
        ]

        [[mcp_servers]]
        name = "sealed"
        command = ["python3", "/workflow/code/hostile_mcp.py"]
        """
    )
    with outside_server(engine) as outside:
        wf = _workflow(make_workflow, EGRESS_STEP.replace("OUTSIDE_V4", outside.ipv4), toml)
        (wf / "outside-ca.pem").write_text(outside.ca_pem)
        options = RunOptions(upstream_networks=(outside.network,))
        record = TestRun(wf, "step1", options).execute()
        seen = outside.seen()
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    out = json.loads((wf / "runs" / record.id / "g" / "out.json").read_text())
    assert out["get"]["http"] == [200, "hello from outside /page"]
    assert out["get"]["proxy"] == "http://127.0.0.1:3128"
    assert "OSError" in out["get"]["direct"] or "unreachable" in out["get"]["direct"].lower()
    assert out["post"]["http"][0] == 403 and "TEST MODE" in out["post"]["http"][1]
    assert out["step_list"]["http"][0] == 403  # the step's list is not the server's
    assert out["tls_get"]["http"] == [200, "hello from outside /tls-page"]
    assert out["tls_post"]["http"][0] == 403 and "TEST MODE" in out["tls_post"]["http"][1]
    assert out["sealed"]["proxy"] == "" and not str(out["sealed"]["http"]).startswith("[")
    assert not out["sealed"]["direct"].startswith("ok")
    assert [(s.get("method"), s.get("path")) for s in seen] == [
        ("GET", "/page"),
        ("GET", "/tls-page"),
    ]
    actions = Path(record.workflow_dir) / "runs" / record.id / "test_mode_actions.jsonl"
    http = [ln for ln in call_lines(actions) if ln.tool == "http"]  # each start has its outcome
    assert [(ln.decision, ln.detail.get("mcp_server"), ln.detail.get("tls")) for ln in http] == [
        ("allow", "fetcher", None),
        ("stub", "fetcher", None),
        ("stub", "fetcher", None),
        ("allow", "fetcher", "inspected"),
        ("stub", "fetcher", "inspected"),
    ]
    assert [ln.detail.get("status") for ln in http if ln.decision == "allow"] == [200, 200]
