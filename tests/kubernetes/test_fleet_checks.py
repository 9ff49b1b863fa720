"""What holds on the runner's host holds through the fleet, on each of the two nodes.

Runs submitted as Jobs (`FleetRun`, `placement = "scheduler"`) and placed on one node
by cordoning the other while the scheduler binds their runner's Pod (the run's Pod is
then pinned to that node by name, whatever is cordoned after): the job-board example,
the escape battery and the egress step (`tests/kubernetes/battery.py`, the programs
and assertions `test_checks_on_pods.py` runs with the runner on this host), and a
stdio MCP server. `[bridge] networks` is refused when the run is submitted, before
any Job exists. Every record is read from the controller's view of the claim, as a
controller does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from sandbox.backends.kubernetes import fleet
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.record import RunStatus
from sandbox.contracts.wire import ActionLine
from sandbox.hostfs import hostmount
from testbed.kubernetes.cluster import Cluster
from tests.conftest import tree_digest, write_workflow
from tests.kubernetes.battery import (
    SAFE,
    assert_battery_finished_without_trace,
    assert_battery_not_forged,
    assert_battery_traps_held,
    assert_direct_reaches_only_the_guard,
    assert_egress_reads_pass_writes_stubbed,
    battery_escapes,
    battery_of,
    battery_workflow,
    egress_of,
    egress_workflow,
    outside_server,
    validated,
)
from tests.kubernetes.fleetparts import RUN_DEADLINE_S, cli_host_config, only_schedulable, submit
from tests.kubernetes.pods import exec_in, no_pods_or_secrets, server_pod, start_server
from tests.paths import REPO
from tests.security.conftest import assert_attempts_match

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(900)]

BIND_DEADLINE_S = 120.0


def _bound(run: fleet.FleetRun, node: str) -> None:
    """Until the scheduler bound the run's runner Pod (polled, with a deadline)."""
    deadline = time.monotonic() + BIND_DEADLINE_S
    while True:
        pod = run._pod()
        if pod is not None and pod.spec.node_name:
            assert pod.spec.node_name == node
            return
        assert time.monotonic() < deadline, f"the runner of {run.name} was never placed"
        time.sleep(0.2)


def _on_each_node(
    kube_cluster: Cluster,
    core: Any,
    settings: BackendConfig,
    jobs: list[list[Path]],
    step: str = "step1",
) -> list[list[fleet.FleetRun]]:
    """`jobs[i]`'s workflows submitted while only node i is schedulable, each back once
    its runner is bound there: all of them run at once, node by node as asked."""
    placed: list[list[fleet.FleetRun]] = []
    try:
        for node, workflows in zip(kube_cluster.node_names, jobs, strict=True):
            with only_schedulable(core, node, kube_cluster.node_names):
                runs: list[fleet.FleetRun] = []
                placed.append(runs)
                for wf in workflows:
                    runs.append(submit(kube_cluster, settings, wf, step))
                for run in runs:
                    _bound(run, node)
        for runs in placed:
            for run in runs:
                assert run.wait(RUN_DEADLINE_S), f"{run.name} did not end in time"
    except BaseException:
        for runs in placed:
            for run in runs:
                run.cancel()
        raise
    return placed


# --- the job-board example ---------------------------------------------------------

JOBBOARD = REPO / "examples" / "job-board"
JOBBOARD_PORT = 8080
JOBBOARD_UPSTREAM = 'upstream = "http://jobboard:8080"'


def test_job_board_bid_submit_passes_with_its_stubs_on_each_node(
    kube_cluster: Cluster,
    kube_core: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """The example's bid-submit, a copy of the workflow per node, its fake API in a Pod
    of its own. The copy names that Pod's address as its `[bridge] upstream` (the
    fleet carries no `--upstream-bridge`; a Pod has no Docker alias): the step, its
    expectations and its stubs are the example's."""
    assert fleet_settings.claim_root is not None
    root = Path(fleet_settings.claim_root)
    api = root / "fake_api"
    shutil.copytree(JOBBOARD / "fake_api", api, ignore=shutil.ignore_patterns("__pycache__"))
    command = ["python3", "/api/server.py", "--port", str(JOBBOARD_PORT)]
    board = server_pod("jobboard", command, {"/api": api})
    board_ip = start_server(kube_core, fleet_settings.namespace, board)
    sys.path.insert(0, str(JOBBOARD.parent))
    from setup import ensure_db

    copies, before = [], []
    for index, _ in enumerate(kube_cluster.node_names):
        wf = root / f"node-{index}" / "job-board"
        shutil.copytree(
            JOBBOARD, wf, ignore=shutil.ignore_patterns("test-*", "db.sqlite*", "__pycache__")
        )
        toml = (wf / "workflow.toml").read_text()
        assert JOBBOARD_UPSTREAM in toml
        upstream = f'upstream = "http://{board_ip}:{JOBBOARD_PORT}"'
        (wf / "workflow.toml").write_text(toml.replace(JOBBOARD_UPSTREAM, upstream))
        ensure_db(wf)
        copies.append(wf)
        before.append(tree_digest(wf))

    placed = _on_each_node(
        kube_cluster, kube_core, fleet_settings, [[wf] for wf in copies], "bid-submit"
    )
    for node, wf, digest, (run,) in zip(
        kube_cluster.node_names, copies, before, placed, strict=True
    ):
        record = validated(run.record(), [node], wf)
        assert record.status is RunStatus.PASSED, (node, record.reason, record.stderr.text)
        assert run.node == node
        assert record.preflight is not None and record.preflight.ok
        assert {s.tool for s in record.stubbed} >= {"upwork_submit_proposal", "agent_browser"}
        assert record.actions.allow > 0  # its reads reached the fake API through the guard
        assert tree_digest(wf) == digest
        assert not hostmount.mounts_below(wf)
    state_of = f"http://127.0.0.1:{JOBBOARD_PORT}/state"
    fetch = f"import urllib.request;print(urllib.request.urlopen({state_of!r}).read().decode())"
    state = json.loads(
        exec_in(kube_core, fleet_settings.namespace, "jobboard", ["python3", "-c", fetch])
    )
    assert state["proposals"] == [] and state["connects"] == 100  # no write reached it
    no_pods_or_secrets(kube_core, fleet_settings.namespace)


# --- the escape battery and the egress step ----------------------------------------


def test_escape_and_egress_checks_hold_on_each_node_through_the_fleet(
    kube_cluster: Cluster,
    kube_core: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """Two fleet runs per node, all four at once: the whole escape battery in one step
    program (every attempt of `battery.SAFE`: files, mounts, /proc, privileges,
    devices, the DB and the host-side collector's traps, and the Pod's own: the
    service-account token and tokens in the environment, the kubelet's files, the
    node's containerd socket, the kubelet's port, the API server), and the egress step
    (reads pass, writes stubbed and recorded, hosts not listed refused, the step's own
    TCP handed to the guard, lookups answered by the guard, no raw socket, no
    firewall), each against its own outside server Pod. The traps and the Crew folder
    name the claim as the runner sees it (`/claim`), where its collector would follow
    them; the containerd socket tried is the node's own."""
    assert fleet_settings.claim_root is not None
    root = Path(fleet_settings.claim_root)
    state = kube_cluster.state
    sockets = [state.containerd_socket, *(n.containerd_socket for n in state.extra_nodes)]
    namespace = fleet_settings.namespace
    nodes = kube_cluster.node_names
    with ExitStack() as stack:
        outsides, built, egress, before = [], [], [], []
        for index, socket in enumerate(sockets):
            outsides.append(
                stack.enter_context(
                    outside_server(
                        kube_cluster,
                        kube_core,
                        namespace,
                        root / f"srv-{index}",
                        f"outside-{index}",
                    )
                )
            )
            folder = root / f"battery-{index}"
            folder.mkdir()
            seen = Path(fleet.RUNNER_CLAIM_ROOT) / folder.name
            built.append(stack.enter_context(battery_workflow(folder, str(socket), seen)))
            (root / f"egress-{index}").mkdir()
            egress.append(egress_workflow(root / f"egress-{index}", outsides[index]))
            before.append(tree_digest(egress[index]))
        started = time.monotonic()
        jobs = [[b.wf, e] for b, e in zip(built, egress, strict=True)]
        placed = _on_each_node(kube_cluster, kube_core, fleet_settings, jobs)
        wall_s = time.monotonic() - started
        batteries = [
            battery_of(b, runs[0].record(), kube_core, namespace, wall_s)
            for b, runs in zip(built, placed, strict=True)
        ]
    egress_runs = [
        egress_of(wf, digest, runs[1].record(), outside)
        for wf, digest, runs, outside in zip(egress, before, placed, outsides, strict=True)
    ]
    for node, battery, run, runs in zip(nodes, batteries, egress_runs, placed, strict=True):
        assert [r.node for r in runs] == [node, node]
        assert_battery_finished_without_trace(battery, [node])
        assert_attempts_match(battery, SAFE)
        assert battery_escapes(battery) == [], node
        assert_battery_not_forged(battery)
        assert_battery_traps_held(battery)
        assert_egress_reads_pass_writes_stubbed(run, [node])
        assert_direct_reaches_only_the_guard(run)
    no_pods_or_secrets(kube_core, namespace)


# --- stdio MCP servers and bridge.networks -----------------------------------------

HOSTILE = REPO / "tests" / "fakes" / "hostile_mcp.py"

MCP_SERVER = """
[[crew_folders]]
name = "m"
path = "../crew-m"

[[mcp_servers]]
name = "tools"
command = ["python3", "/workflow/code/hostile_mcp.py"]
env = { HOSTILE_NAME = "tools" }
"""

MCP_STEP = """
import json
import agentworks_mcp as mcp
out = {}
with mcp.connect("tools") as tools:
    out["read"] = tools.call_tool("echo", {"a": 1})
    out["write"] = tools.call_tool("sneaky_write", {"b": 2})
out["crew"] = open("/crew/m/crew.txt").read()
json.dump(out, open("out.json", "w"))
"""


def _text(result: dict[str, Any]) -> str:
    return "\n".join(b.get("text", "") for b in result.get("content", []) if "text" in b)


def test_a_stdio_mcp_server_runs_beside_the_step_on_the_runners_node(
    kube_cluster: Cluster,
    kube_core: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
    mcp_image: None,
) -> None:
    """A stdio server in the run's Pod on the node the scheduler picked (the second):
    its read-only tool answered, its write stubbed, both in the action log. (The
    workflow names its Crew folder relative to itself, as docs/guides/fleet.md says.)"""
    assert fleet_settings.claim_root is not None
    crew = Path(fleet_settings.claim_root) / "crew-m"
    crew.mkdir()
    (crew / "crew.txt").write_text("crew data")
    wf = write_workflow(
        Path(fleet_settings.claim_root),
        command=["python3", "/workflow/code/step.py"],
        extra_toml=MCP_SERVER,
    )
    (wf / "code" / "step.py").write_text(textwrap.dedent(MCP_STEP))
    shutil.copy(HOSTILE, wf / "code" / "hostile_mcp.py")
    before = tree_digest(wf)
    node = kube_cluster.node_names[1]
    with only_schedulable(kube_core, node, kube_cluster.node_names):
        run = submit(kube_cluster, fleet_settings, wf, "step1")
        _bound(run, node)
    assert run.wait(RUN_DEADLINE_S)
    record = validated(run.record(), [node], wf)
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    out = json.loads((wf / "runs" / record.id / "g" / "out.json").read_text())
    assert json.loads(_text(out["read"])) == {"a": 1}
    assert "TEST MODE: sneaky_write was NOT run" in _text(out["write"])
    assert out["crew"] == "crew data"
    log = (wf / "runs" / record.id / "test_mode_actions.jsonl").read_text().splitlines()
    lines = [ActionLine.model_validate_json(x) for x in log]
    mcp = [(ln.tool, ln.decision) for ln in lines if ln.category == "mcp" and ln.event != "outcome"]
    assert mcp == [("mcp:tools/echo", "allow"), ("mcp:tools/sneaky_write", "stub")]
    assert (record.actions.allow, record.actions.stub) == (1, 1)
    assert set(record.mcp_servers) == {"tools"} and record.mcp_servers["tools"].stderr_file
    assert tree_digest(wf) == before
    no_pods_or_secrets(kube_core, fleet_settings.namespace)


def test_bridge_networks_are_refused_when_the_run_is_submitted(
    tmp_path: Path,
    kube_cluster: Cluster,
    kube_api: Any,
    fleet_settings: BackendConfig,
    cleanup_jobs: None,
) -> None:
    """Docker networks a run's Pod cannot join: refused by `FleetRun.submit` and by
    `sandbox run` (exit 4, configuration), with no Job made, rather than run without
    them or fail on a node."""
    assert fleet_settings.claim_root is not None
    wf = write_workflow(
        Path(fleet_settings.claim_root),
        command=["true"],
        extra_toml='[bridge]\nupstream = "http://upstream:8080"\nnetworks = ["upstreams"]\n',
    )
    with pytest.raises(ConfigError, match=r"\[bridge\] networks"):
        submit(kube_cluster, fleet_settings, wf, "step1")
    host = cli_host_config(tmp_path, kube_cluster, fleet_settings)
    argv = ["run", str(wf), "step1", "--backend", "kubernetes", "--host-config", str(host)]
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "sandbox"), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 4, (proc.stdout, proc.stderr)
    assert "[bridge] networks" in proc.stderr
    assert client.BatchV1Api(kube_api).list_namespaced_job(fleet_settings.namespace).items == []
    assert not (wf / "runs").exists() or not list((wf / "runs").glob("test-*"))
