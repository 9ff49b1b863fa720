"""Test runs on the real local cluster through the Kubernetes backend (`TestRun` as is).

Each test's workflow lives under the node's storage (`Cluster.node_storage`), so the
run's disk and workflow view, mounted on the host by the runner, are what the node's
hostPath volumes show. Processes are read and signalled from the host by their
cgroup (the run's Pod uid), never by name: other runs on this host use the same uids.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sandbox.backends import BackendFactory
from sandbox.backends.kubernetes import pod as manifests
from sandbox.contracts import names
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.layout import DISK_MOUNT, GUARD_UID, STEP_UID
from sandbox.contracts.record import RunStatus, read_record
from sandbox.hostfs import hostmount
from sandbox.run.testrun import RunOptions, TestRun
from testbed.kubernetes.cluster import Cluster
from tests.conftest import ThreadedRun, call_lines, tree_digest, write_workflow
from tests.kubernetes.fleetparts import write_host_config
from tests.kubernetes.pods import (
    OUTSIDE_PORT,
    container_state,
    exec_in,
    no_pods_or_secrets,
    outside_server_pod,
    pod_of,
    proc_status,
    processes_of,
    server_pod,
    start_server,
    watch_pod,
)

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
JOBBOARD = REPO / "examples" / "job-board"
JOBBOARD_PORT = 8080


def test_job_board_bid_submit_passes_with_its_stubs(
    kube_core: Any, kube_namespace: str, pods: BackendFactory, node_dir: Path
) -> None:
    wf = node_dir / "job-board"
    shutil.copytree(
        JOBBOARD, wf, ignore=shutil.ignore_patterns("test-*", "db.sqlite*", "__pycache__")
    )
    sys.path.insert(0, str(JOBBOARD.parent))
    from setup import ensure_db

    ensure_db(wf)
    before = tree_digest(wf)
    command = ["python3", "/api/server.py", "--port", str(JOBBOARD_PORT)]
    board_ip = start_server(
        kube_core,
        kube_namespace,
        server_pod("jobboard", command, {"/api": wf / "fake_api"}),
    )
    options = RunOptions(upstream_bridge=f"http://{board_ip}:{JOBBOARD_PORT}")
    record = TestRun(wf, "bid-submit", options, backend=pods).execute()

    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    assert record.backend == "kubernetes" and record.node in ("127.0.0.1", "127.0.0.2")
    assert record.preflight is not None and record.preflight.ok
    assert {s.tool for s in record.stubbed} >= {"upwork_submit_proposal", "agent_browser"}
    assert record.actions.allow > 0  # its reads reached the fake API through the guard
    assert tree_digest(wf) == before
    state = json.loads(
        exec_in(
            kube_core,
            kube_namespace,
            "jobboard",
            [
                "python3",
                "-c",
                "import urllib.request;"
                f"print(urllib.request.urlopen('http://127.0.0.1:{JOBBOARD_PORT}/state').read().decode())",
            ],
        )
    )
    assert state["proposals"] == [] and state["connects"] == 100
    assert read_record(wf / "runs" / record.id) == record
    no_pods_or_secrets(kube_core, kube_namespace)
    assert not hostmount.mounts_below(wf)


PROBE_STEP = r"""
import errno, json, os, socket, sys
out = {}
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
def write(path):
    with open(path, "w") as f:
        f.write("x")
out["workflow_write"] = attempt(lambda: write("/workflow/probe"))
out["workflow_code_write"] = attempt(lambda: write("/workflow/code/probe"))
out["root_write"] = attempt(lambda: write("/probe"))
out["group_write"] = attempt(lambda: write("out.txt"))
host, port = sys.argv[1], int(sys.argv[2])
def outside():
    # The firewall redirects the connection to the guard, which refuses what is neither
    # HTTP nor TLS and closes it: an answer would be the outside server's.
    with socket.create_connection((host, port), timeout=5) as conn:
        conn.sendall(b"\x00not-http\n")
        conn.settimeout(10)
        if conn.recv(100):
            raise OSError(0, "ANSWERED")
out["outside"] = attempt(outside)
status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
out["caps"] = {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
print("PROBE " + json.dumps(out), flush=True)
"""


def test_the_step_cannot_reach_outside_or_write_the_workflow(
    kube_core: Any, kube_namespace: str, pods: BackendFactory, node_dir: Path
) -> None:
    outside_ip = start_server(kube_core, kube_namespace, outside_server_pod())
    wf = write_workflow(
        node_dir,
        command=["python3", "/workflow/code/probe.py", outside_ip, str(OUTSIDE_PORT)],
    )
    (wf / "code" / "probe.py").write_text(PROBE_STEP)
    before = tree_digest(wf)
    options = RunOptions(canary=f"{outside_ip}:{OUTSIDE_PORT}")
    record = TestRun(wf, "step1", options, backend=pods).execute()

    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    # The executor's own check found the fake outside server closed before the step ran.
    assert record.preflight is not None and record.preflight.ok, record.preflight
    line = next(ln for ln in record.stderr.text.splitlines() if ln.startswith("PROBE "))
    probe = json.loads(line[6:])
    assert probe["outside"] in ("ok", "ECONNRESET"), probe  # closed by the guard, unanswered
    refused = [ln for ln in call_lines(wf / "runs" / record.id / "test_mode_actions.jsonl")
               if ln.tool == "http" and ln.arguments.get("method") == "TCP"]  # fmt: skip
    assert [ln.detail["destination"] for ln in refused] == [f"{outside_ip}:{OUTSIDE_PORT}"]
    assert probe["workflow_write"] == probe["workflow_code_write"] == "EROFS"
    assert probe["root_write"] == "EROFS" and probe["group_write"] == "ok"
    assert all(int(v, 16) == 0 for v in probe["caps"].values()), probe["caps"]
    assert tree_digest(wf) == before
    assert "out.txt" in record.files.created
    no_pods_or_secrets(kube_core, kube_namespace)


HOLD_STEP = r"""
import os, time
open("ready", "w").close()
deadline = time.monotonic() + 240
while not os.path.exists("go") and time.monotonic() < deadline:
    time.sleep(0.05)
print("released", flush=True)
"""


HOST_NAMESPACES = ("net", "pid", "ipc", "uts", "mnt")


def _hold_workflow(node_dir: Path) -> Path:
    wf = write_workflow(node_dir, command=["python3", "/workflow/code/hold.py"], timeout_s=300)
    (wf / "code" / "hold.py").write_text(HOLD_STEP)
    return wf


def test_the_running_step_holds_no_capability_read_from_the_node(
    kube_core: Any, kube_namespace: str, pods: BackendFactory, node_dir: Path
) -> None:
    wf = _hold_workflow(node_dir)
    with ThreadedRun(wf, backend=pods) as run:
        ready = run.wait_for_in_group("ready")
        pod = pod_of(kube_core, kube_namespace, run.layout.run_id)
        steps = processes_of(pod.metadata.uid, STEP_UID)
        guards = processes_of(pod.metadata.uid, GUARD_UID)
        assert steps and guards
        for proc in [*steps, *guards]:
            status = proc_status(proc.pid)
            for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                assert int(status[key], 16) == 0, (proc.pid, key, status[key])
            assert status["NoNewPrivs"].strip() == "1"
            assert status["Seccomp"].strip() == "2"
            # No host namespace: each is the Pod's own, not the node's (this runner's).
            for ns in HOST_NAMESPACES:
                ours = os.readlink(f"/proc/{proc.pid}/ns/{ns}")
                assert ours != os.readlink(f"/proc/self/ns/{ns}"), (proc.pid, ns)
        # The network, IPC and UTS namespaces are the Pod's, shared by its two
        # containers; each container has its own process and mount namespace.
        step_ns = {ns: os.readlink(f"/proc/{steps[0].pid}/ns/{ns}") for ns in HOST_NAMESPACES}
        guard_ns = {ns: os.readlink(f"/proc/{guards[0].pid}/ns/{ns}") for ns in HOST_NAMESPACES}
        assert {ns for ns in HOST_NAMESPACES if step_ns[ns] == guard_ns[ns]} == {
            "net",
            "ipc",
            "uts",
        }
        (ready.parent / "go").touch()
    assert run.record.status is RunStatus.PASSED, (run.record.reason, run.record.stderr.text)
    assert "released" in run.record.stderr.text


def test_killing_the_guard_kills_the_step(
    kube_core: Any, kube_namespace: str, pods: BackendFactory, node_dir: Path
) -> None:
    wf = _hold_workflow(node_dir)
    with ThreadedRun(wf, join_s=180, backend=pods) as run:
        run.wait_for_in_group("ready")
        pod = pod_of(kube_core, kube_namespace, run.layout.run_id)
        guards = processes_of(pod.metadata.uid, GUARD_UID)
        assert guards
        started = time.monotonic()
        for proc in guards:
            # one may be gone already: a child of the guard dies with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
    record = run.record
    assert record.status is RunStatus.ERROR and "guard stopped" in record.reason, record.reason
    assert record.exit_code != 0
    assert "released" not in record.stderr.text
    assert time.monotonic() - started < 120
    no_pods_or_secrets(kube_core, kube_namespace)


def test_a_step_past_its_timeout_is_killed(
    kube_core: Any, kube_namespace: str, pods: BackendFactory, node_dir: Path
) -> None:
    wf = _hold_workflow(node_dir)
    started = time.monotonic()
    record = TestRun(wf, "step1", RunOptions(timeout_s=3), backend=pods).execute()
    assert record.status is RunStatus.TIMEOUT, (record.reason, record.stderr.text)
    assert record.exit_code is None and "released" not in record.stderr.text
    assert time.monotonic() - started < 120
    no_pods_or_secrets(kube_core, kube_namespace)


def test_a_killed_runner_leaves_a_valid_record_and_gc_removes_the_pod(
    kube_cluster: Cluster,
    kube_core: Any,
    kube_namespace: str,
    node_dir: Path,
    settings: BackendConfig,
) -> None:
    wf = _hold_workflow(node_dir)
    host_config = write_host_config(node_dir, settings)
    cli = [sys.executable, "-m", "sandbox.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runner = subprocess.Popen(
        [*cli, "run", str(wf), "step1", "--host-config", str(host_config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        runs = wf / "runs"
        deadline = time.monotonic() + 120
        ready: Path | None = None
        while ready is None:
            ready = (
                next(runs.glob(f"test-*/{DISK_MOUNT}/group/ready"), None) if runs.exists() else None
            )
            assert time.monotonic() < deadline, "the step never started"
            assert runner.poll() is None, "the runner ended before its step started"
            time.sleep(0.05)
        run_root = ready.parents[2]
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=30)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    assert read_record(run_root).status is RunStatus.RUNNING
    pod = pod_of(kube_core, kube_namespace, run_root.name)
    assert pod.metadata.name == manifests.object_name(run_root.name)

    done = subprocess.run(
        [*cli, "gc", str(wf), "--host-config", str(host_config), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    report = json.loads(done.stdout)
    assert report["pods_removed"] == [pod.metadata.name], report
    assert report["errors"] == []
    record = read_record(run_root)
    assert record.status is RunStatus.KILLED and "runner died" in record.reason
    assert not hostmount.mounts_below(run_root)
    # The Secret goes with its Pod (the cluster's garbage collector, or gc itself).
    deadline = time.monotonic() + 60
    while True:
        try:
            no_pods_or_secrets(kube_core, kube_namespace)
            break
        except AssertionError:
            assert time.monotonic() < deadline, "the run's Secret outlived its Pod"
            time.sleep(0.2)
    conn = sqlite3.connect(f"file:{wf / 'db' / 'db.sqlite'}?mode=ro", uri=True)
    assert conn.execute("SELECT v FROM t").fetchall() == [("one",)]


def _bare_pod_s(core: Any, namespace: str, index: int) -> float:
    """Create -> container ended -> deleted, for one `true` container with no hardening."""
    name = f"bare-{index}"
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "c",
                    "image": names.STEP_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["true"],
                }
            ],
        },
    }
    started = time.monotonic()
    created = core.create_namespaced_pod(namespace, manifest)
    watch_pod(
        core,
        namespace,
        name,
        created.metadata.resource_version,
        lambda p: getattr(container_state(p, "c"), "terminated", None) is not None,
    )
    core.delete_namespaced_pod(name, namespace, grace_period_seconds=1)
    gone = time.monotonic() + 60
    while time.monotonic() < gone:
        if not core.list_namespaced_pod(namespace, field_selector=f"metadata.name={name}").items:
            break
        time.sleep(0.05)
    return time.monotonic() - started


def test_startup_figures_noop_run_against_a_bare_pod(
    kube_core: Any, kube_namespace: str, pods: BackendFactory, node_dir: Path, capsys: Any
) -> None:
    """Figures, not a target: a no-op test run on the cluster against a bare Pod."""
    wf = write_workflow(node_dir, command="true", db_sql=None)
    runs, bare = [], []
    for i in range(4):
        t0 = time.monotonic()
        record = TestRun(wf, "step1", backend=pods).execute()
        runs.append(time.monotonic() - t0)
        assert record.status is RunStatus.PASSED, record.reason
        bare.append(_bare_pod_s(kube_core, kube_namespace, i))
    run_s, bare_s = sorted(runs[1:])[1], sorted(bare[1:])[1]  # the median after a warm-up
    with capsys.disabled():
        print(
            f"\nno-op test run {run_s:.2f} s, bare one-container Pod {bare_s:.2f} s: "
            f"{run_s / bare_s:.2f}x (create to gone, median of 3 after one warm-up)"
        )
