"""The Docker suite's escape, egress and fault checks, run against Pods on the local cluster.

The runner is this host; the step programs, and what is asserted of their runs, are
`tests/kubernetes/battery.py`'s (shared with the fleet's `test_fleet_checks.py`). The
battery and the egress run run at once, in one namespace of this module. The guard
killed in the middle of a forwarded call (`tests/scenarios/test_mcp_isolation_engine.py`'s
check, here for a bridge call held by a slow upstream Pod) fails the call closed,
and the record says so.

Every record read here validates against the published JSON Schema and names the
node its Pod ran on.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandbox.backends import BackendFactory
from sandbox.backends.choose import connect_backend
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.layout import GUARD_UID
from sandbox.contracts.record import RunStatus
from sandbox.run.testrun import RunOptions, TestRun
from testbed.kubernetes.cluster import Cluster
from testbed.kubernetes.fleetsetup import local_settings
from testbed.kubernetes.namespace import namespace_of_its_own
from tests.conftest import ThreadedRun, tree_digest, write_workflow
from tests.kubernetes.battery import (
    POD_KNOWN_HOLES,
    SAFE,
    EgressRun,
    Outside,
    PodBattery,
    assert_battery_finished_without_trace,
    assert_battery_not_forged,
    assert_battery_traps_held,
    assert_direct_reaches_only_the_guard,
    assert_egress_reads_pass_writes_stubbed,
    battery_of,
    battery_workflow,
    egress_of,
    egress_workflow,
    outside_server,
    pod_log,
    validated,
)
from tests.kubernetes.pods import (
    pod_of,
    processes_of,
    run_objects,
    server_pod,
    start_server,
)
from tests.security.conftest import assert_attempts_match, attempt_params, check

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def namespace(kube_core: Any) -> Iterator[str]:
    with namespace_of_its_own(kube_core) as name:
        yield name


@pytest.fixture(scope="module")
def settings(kube_cluster: Cluster, namespace: str) -> BackendConfig:
    return local_settings(kube_cluster, namespace)


@pytest.fixture(scope="module")
def pods(settings: BackendConfig) -> BackendFactory:
    return lambda: connect_backend(settings)


@pytest.fixture(scope="module")
def module_dir(kube_cluster: Cluster) -> Iterator[Path]:
    """This module's folder on the node's storage."""
    path = kube_cluster.node_storage / f"m-{secrets.token_hex(4)}"
    path.mkdir()
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def outside(
    kube_cluster: Cluster, kube_core: Any, namespace: str, module_dir: Path
) -> Iterator[Outside]:
    with outside_server(kube_cluster, kube_core, namespace, module_dir / "srv") as server:
        yield server


@dataclass
class PodRuns:
    battery: PodBattery
    egress: EgressRun


def _battery(
    root: Path, pods: BackendFactory, core: Any, namespace: str, socket: str
) -> PodBattery:
    """The battery's run through the Kubernetes backend, the runner on this host."""
    with battery_workflow(root, socket) as built:
        started = time.monotonic()
        record = TestRun(built.wf, "step1", RunOptions(), backend=pods).execute()
        return battery_of(built, record, core, namespace, time.monotonic() - started)


def _egress(root: Path, pods: BackendFactory, outside: Outside) -> EgressRun:
    wf = egress_workflow(root, outside)
    before = tree_digest(wf)
    record = TestRun(wf, "step1", RunOptions(), backend=pods).execute()
    return egress_of(wf, before, record, outside)


@pytest.fixture(scope="module")
def runs(
    kube_cluster: Cluster,
    kube_core: Any,
    namespace: str,
    pods: BackendFactory,
    module_dir: Path,
    outside: Outside,
) -> PodRuns:
    """The battery and the egress run, at once (each its own Pod in the namespace)."""
    socket = str(kube_cluster.state.containerd_socket)
    (module_dir / "battery").mkdir()
    (module_dir / "egress").mkdir()
    with ThreadPoolExecutor(2) as pool:
        battery = pool.submit(_battery, module_dir / "battery", pods, kube_core, namespace, socket)
        egress = pool.submit(_egress, module_dir / "egress", pods, outside)
        return PodRuns(battery.result(), egress.result())


# --- escape: the battery ---------------------------------------------------------------


def test_battery_run_finished_and_left_no_trace(runs: PodRuns, kube_cluster: Cluster) -> None:
    assert_battery_finished_without_trace(runs.battery, kube_cluster.node_names)


def test_battery_every_reported_attempt_is_asserted(runs: PodRuns) -> None:
    assert_attempts_match(runs.battery, SAFE)


@pytest.mark.parametrize("name", attempt_params(SAFE, POD_KNOWN_HOLES))
def test_battery_attempt_is_contained(runs: PodRuns, name: str) -> None:
    check(runs.battery, name, SAFE[name])


def test_battery_record_and_action_log_were_not_forged(runs: PodRuns) -> None:
    assert_battery_not_forged(runs.battery)


def test_battery_host_collector_never_read_through_the_traps(runs: PodRuns) -> None:
    assert_battery_traps_held(runs.battery)


# --- egress ----------------------------------------------------------------------------


# Behind the Landlock wall, what a step normally writes still takes.
ORDINARY_WRITES = """
import os, sqlite3
with open("made.txt", "w") as handle:
    handle.write("made")
with open("/tmp/scratch", "w") as handle:
    handle.write("scratch")
with open("/dev/null", "w") as handle:
    handle.write("gone")
con = sqlite3.connect(os.environ["DB_PATH"])
con.execute("INSERT INTO t VALUES (2, 'two')")
con.commit()
con.close()
print("all written")
"""


def test_ordinary_writes_work_behind_the_pods_landlock_wall(
    pods: BackendFactory, module_dir: Path, kube_cluster: Cluster
) -> None:
    root = module_dir / "ordinary"
    root.mkdir()
    wf = write_workflow(root, command=["python3", "/workflow/code/step.py"])
    (wf / "code" / "step.py").write_text(ORDINARY_WRITES)
    record = validated(
        TestRun(wf, "step1", RunOptions(), backend=pods).execute(), kube_cluster.node_names
    )
    assert record.status is RunStatus.PASSED, f"{record.reason}; log: {pod_log(record)[-800:]}"
    assert "all written" in record.stdout.text + record.stderr.text
    wall = record.landlock
    assert wall.required and wall.applied and wall.abi is not None and wall.abi >= 1, wall
    if wall.abi >= 6:
        assert wall.scoped == ["abstract_unix_socket", "signal"]
    assert (wf / "runs" / record.id / "g" / "made.txt").read_text() == "made"
    assert record.db_diff is not None
    assert [(t.name, t.inserted) for t in record.db_diff.tables] == [("t", 1)]


def test_egress_reads_pass_writes_are_stubbed_other_hosts_refused(
    runs: PodRuns, kube_cluster: Cluster
) -> None:
    assert_egress_reads_pass_writes_stubbed(runs.egress, kube_cluster.node_names)


def test_egress_direct_connections_reach_the_guard_and_nothing_else(runs: PodRuns) -> None:
    assert_direct_reaches_only_the_guard(runs.egress)


# --- faults ----------------------------------------------------------------------------

# Accepts, reads the request, says so on its log, and never answers.
SLOW_UPSTREAM = r"""
import socket, threading, time
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8080))
srv.listen(8)
def hold(conn):
    head = conn.recv(65536)
    print("REQUEST " + head.split(b"\r\n", 1)[0].decode(errors="replace"), flush=True)
    time.sleep(600)
while True:
    conn, _ = srv.accept()
    threading.Thread(target=hold, args=(conn,), daemon=True).start()
"""

CALL_STEP = """
import agentworks_bridge
reply = agentworks_bridge.call("generate_text_llm", {"prompt": "held upstream"})
print("the call came back: " + repr(reply), flush=True)
"""


def test_a_guard_killed_mid_call_fails_the_call_closed_and_the_record_says_so(
    kube_cluster: Cluster, kube_core: Any, namespace: str, pods: BackendFactory, module_dir: Path
) -> None:
    root = module_dir / "fault"
    root.mkdir()
    (root / "slow").mkdir()
    (root / "slow" / "slow.py").write_text(SLOW_UPSTREAM)
    slow = server_pod("slow-upstream", ["python3", "/srv/slow.py"], {"/srv": root / "slow"})
    slow_ip = start_server(kube_core, namespace, slow)
    wf = write_workflow(root, command=["python3", "/workflow/code/step.py"], timeout_s=300)
    (wf / "code" / "step.py").write_text(CALL_STEP)
    options = RunOptions(upstream_bridge=f"http://{slow_ip}:8080")
    with ThreadedRun(wf, options, join_s=180, backend=pods) as run:
        actions = run.wait_for_file("test-*/test_mode_actions.jsonl")
        deadline = time.monotonic() + 120
        while "generate_text_llm" not in actions.read_text():
            assert time.monotonic() < deadline, "the call was never logged"
            assert not run.finished
            time.sleep(0.05)
        # The call is in flight: its upstream holds it.
        while "REQUEST" not in kube_core.read_namespaced_pod_log("slow-upstream", namespace):
            assert time.monotonic() < deadline, "the call never reached its upstream"
            time.sleep(0.1)
        pod = pod_of(kube_core, namespace, actions.parent.name)
        guards = processes_of(pod.metadata.uid, GUARD_UID)
        assert guards
        for proc in guards:
            # One may end before its turn (its parent killed first): gone is the aim.
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
    assert run.finished, "the run went on without its guard"
    record = validated(run.record, kube_cluster.node_names)
    assert record.status is RunStatus.ERROR and "guard stopped" in record.reason, record.reason
    assert "the call came back" not in record.stderr.text
    assert [(u.tool, u.decision) for u in record.outcome_unknown] == [
        ("generate_text_llm", "allow")
    ]
    assert record.actions.outcome_unknown == 1
    assert any("outcome unknown" in line for line in record.summary_lines())
    assert run_objects(kube_core, namespace) == []  # the server Pods are not the runs'
