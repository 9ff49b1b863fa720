"""The Docker suite's escape, egress and fault checks, run against Pods on the local cluster.

The step programs are the Docker suite's own: the file, mount, /proc, privilege and
device battery of `tests/security/test_escape_filesystem_process.py` (with a few
attempts only a Pod offers: a service-account token, the kubelet's files in the
container, the node's containerd socket, the kubelet's port), and the egress step of
`tests/scenarios/test_egress_engine.py` with the fake outside server (`tests/fakes/outside_server.py`)
in a Pod of its own, named by its address (a Pod has no Docker network alias). The
battery and the egress run run at once, in one namespace of this module. The guard
killed in the middle of a forwarded call (`tests/scenarios/test_mcp_isolation_engine.py`'s
check, here for a bridge call held by a slow upstream Pod) fails the call closed,
and the record says so.

Every record read here validates against the published JSON Schema and names the
node its Pod ran on.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sqlite3
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from kubernetes import client

from sandbox.backends import BackendFactory
from sandbox.backends.choose import connect_backend
from sandbox.contracts import names
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.layout import GUARD_UID
from sandbox.contracts.record import SCHEMA_PATH, RunStatus, TestRunRecord, read_record
from sandbox.contracts.wire import ActionLine
from sandbox.guard.egress.dns import SYNTHETIC_V4 as SYNTHETIC
from sandbox.hostfs import hostmount
from sandbox.run.testrun import RunOptions, TestRun
from tests.conftest import ThreadedRun, call_lines, tree_digest, write_workflow
from tests.kubernetes.cluster import Cluster
from tests.kubernetes.pods import (
    http_get_in,
    namespace_of_its_own,
    pod_of,
    processes_of,
    run_objects,
    server_pod,
    start_server,
)
from tests.scenarios.test_egress_engine import EGRESS_TOML, THROUGH_PROXY, assert_proxy_step_answers
from tests.security import test_escape_filesystem_process as fs_battery
from tests.security.conftest import (
    Battery,
    assert_attempts_match,
    attempt_params,
    build_workflow,
    check,
    parse_attempts,
)

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
FAKES = REPO / "tests" / "fakes"
OUTSIDE = "outside"
OUTSIDE_HOST = "outside.test"  # the Docker suite's alias, replaced by the Pod's address
KUBELET_PORT = 10250

# Attempts only a Pod offers, appended to the Docker battery's step.
POD_STEP = r"""
SERVICE_ACCOUNT_PATHS = [
    "/var/run/secrets/kubernetes.io/serviceaccount",
    "/run/secrets/kubernetes.io/serviceaccount",
    "/var/run/secrets",
    "/run/secrets",
]


def service_account():
    for path in SERVICE_ACCOUNT_PATHS:
        if os.path.lexists(path):
            return "PRESENT", path
    return "absent"


def env_token():
    # A service-account token is a JWT; the bridge's own token is the step's to use.
    found = [k for k, v in os.environ.items() if v.startswith("eyJ") or (k.startswith("KUBE") and "TOKEN" in k)]
    return ("FOUND", found) if found else "absent"


def unix_connect(path):
    def go():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(path)
        s.close()
        return "CONNECTED"
    return go


def tcp_connect(host, port):
    def go():
        socket.create_connection((host, port), timeout=5).close()
        return "CONNECTED"
    return go


attempt("service-account token mounted", service_account)
attempt("a token in the environment", env_token)
attempt("write the Pod's /etc/hosts", write_to("/etc/hosts"))
attempt("write /etc/resolv.conf", write_to("/etc/resolv.conf"))
attempt("write /etc/hostname", write_to("/etc/hostname"))
attempt("write /dev/termination-log", write_to("/dev/termination-log"))
attempt("truncate /dev/termination-log", lambda: os.truncate("/dev/termination-log", 0))
attempt("the node's containerd socket", unix_connect("@@CONTAINERD_SOCKET@@"))
attempt("the kubelet's port on loopback", tcp_connect("127.0.0.1", @@KUBELET_PORT@@))
attempt("the cluster's API server (from the environment)", tcp_connect(
    os.environ.get("KUBERNETES_SERVICE_HOST", "10.0.0.1"),
    int(os.environ.get("KUBERNETES_SERVICE_PORT", "443"))))
"""

POD_SAFE: dict[str, set[str]] = {
    "service-account token mounted": {"absent"},
    "a token in the environment": {"absent"},
    # The kubelet's files are the node's root's, 0644: the step's uid cannot write them.
    "write the Pod's /etc/hosts": {"EACCES", "EROFS"},
    "write /etc/resolv.conf": {"EACCES", "EROFS"},
    "write /etc/hostname": {"EACCES", "EROFS"},
    # The kubelet's termination-message file is the node's (mode 0666, read-write):
    # the executor's Landlock wall alone refuses it.
    "write /dev/termination-log": {"EACCES"},
    "truncate /dev/termination-log": {"EACCES"},
    "the node's containerd socket": {"ENOENT"},
    # The firewall rejects every port on loopback but the guard's, at once.
    "the kubelet's port on loopback": {"ECONNREFUSED"},
    # No route from the Pod's network to the service range (no kube-proxy), and the
    # firewall would reject it first where there is one.
    "the cluster's API server (from the environment)": {"ECONNREFUSED", "ENETUNREACH"},
}

# What a Pod gives every container that the step can use: strict xfails (closing one
# is noticed), each with what bounds it. None left: the termination-message file was
# one until the step's Landlock wall.
POD_KNOWN_HOLES: dict[str, str] = {}

SAFE: dict[str, set[str]] = {**fs_battery.SAFE, **POD_SAFE}


def pod_log(record: TestRunRecord) -> str:
    """The step container's one log (the Pod API merges its stdout and stderr)."""
    return record.stdout.text + "\n" + record.stderr.text


def json_lines(text: str) -> list[Any]:
    found = []
    for line in text.splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def validated(record: TestRunRecord, nodes: list[str]) -> TestRunRecord:
    """The record on disk is the one returned, valid against the published schema, and
    names a node of the cluster."""
    run_dir = Path(record.workflow_dir) / "runs" / record.id
    raw = json.loads((run_dir / "test_mode.json").read_text())
    jsonschema.validate(raw, json.loads(SCHEMA_PATH.read_text()))
    assert read_record(run_dir) == record
    assert record.backend == "kubernetes" and record.node in nodes, (record.backend, record.node)
    return record


@pytest.fixture(scope="module")
def namespace(kube_core: Any) -> Iterator[str]:
    with namespace_of_its_own(kube_core) as name:
        yield name


@pytest.fixture(scope="module")
def settings(kube_cluster: Cluster, namespace: str) -> BackendConfig:
    return BackendConfig(
        kind="kubernetes",
        kubeconfig=str(kube_cluster.kubeconfig),
        namespace=namespace,
        image_pull_policy="Never",
        seccomp_profile="step.json",
    )


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


@dataclass
class Outside:
    """The fake outside server's Pod: its address, and what reached it."""

    core: Any
    namespace: str
    ip: str

    def seen(self) -> list[dict[str, Any]]:
        body = http_get_in(self.core, self.namespace, OUTSIDE, "http://127.0.0.1:8080/__seen")
        return list(json.loads(body))


@pytest.fixture(scope="module")
def outside(
    kube_cluster: Cluster, kube_core: Any, namespace: str, module_dir: Path
) -> Iterator[Outside]:
    srv = module_dir / "srv"
    srv.mkdir()
    shutil.copy(FAKES / "outside_server.py", srv / "outside_server.py")
    manifest = server_pod(OUTSIDE, ["python3", "/srv/outside_server.py"], {"/srv": srv})
    ip = start_server(kube_core, namespace, manifest)
    # An exec swaps its client's request method while it runs: a client of its own, so
    # a run's thread never sends a plain call down the exec's websocket.
    api = kube_cluster.api_client()
    server = Outside(client.CoreV1Api(api), namespace, ip)
    try:
        deadline = time.monotonic() + 60
        while True:  # its listeners start in threads beside the main one
            try:
                server.seen()
                break
            except Exception:
                assert time.monotonic() < deadline, "the fake outside server did not come up"
                time.sleep(0.2)
        yield server
    finally:
        api.close()


# The egress step: the Docker suite's proxy checks, then direct attempts (one line each).
DIRECT_POD = """
import errno, socket
direct = {}
def direct_attempt(name, fn):
    try:
        direct[name] = "OPEN: " + str(fn())
    except OSError as exc:
        direct[name] = type(exc).__name__ + ":" + (errno.errorcode.get(exc.errno, "") if exc.errno else "")
def tcp_other(host):
    # Not HTTP, not TLS: the guard the firewall hands it to must close it at once.
    with socket.create_connection((host, 8080), timeout=10) as s:
        s.sendall(b"step-direct-bytes")
        try:
            return "closed: %d bytes" % len(s.recv(100))
        except ConnectionResetError:
            return "closed: reset"
direct_attempt("tcp4", lambda: tcp_other("OUTSIDE_V4"))
direct_attempt("raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
try:
    direct["dns"] = sorted({i[4][0] for i in socket.getaddrinfo("outside.test", 8080, socket.AF_INET)})
except OSError as exc:
    direct["dns"] = type(exc).__name__
direct["iptables"] = subprocess.run(["iptables", "-F"], capture_output=True, text=True).returncode
print(json.dumps(direct))
"""


@dataclass
class EgressRun:
    record: TestRunRecord
    out: dict[str, Any]
    direct: dict[str, Any]
    lines: list[ActionLine]
    seen: list[dict[str, Any]]
    host: str  # the outside server's address, as the allow list names it
    digest_same: bool


@dataclass
class PodRuns:
    battery: Battery
    egress: EgressRun


def _battery(root: Path, pods: BackendFactory, core: Any, namespace: str, socket: str) -> Battery:
    """The Docker battery's workflow (WAL DB, Crew folder, prompt, world-writable files),
    its step with the Pod's own attempts, through the Kubernetes backend."""
    crew = root / "crew-a"
    crew.mkdir()
    (crew / "crew.txt").write_text("crew data")
    secret = root / "host-secret.txt"
    secret.write_text(fs_battery.HOST_SECRET)
    step = fs_battery.STEP.replace("@@HOST_SECRET_PATH@@", str(secret))
    # The kubelet's termination-message file is in every container's /dev (its own
    # attempt below says what the step can do with it).
    step = step.replace('SAFE_DEV = {"null",', 'SAFE_DEV = {"termination-log", "null",', 1)
    assert "termination-log" in step
    pod_step = POD_STEP.replace("@@CONTAINERD_SOCKET@@", socket)
    step += pod_step.replace("@@KUBELET_PORT@@", str(KUBELET_PORT))
    wf = build_workflow(
        root,
        step,
        extra_toml=f'[[crew_folders]]\nname = "a"\npath = "{crew}"\n',
        prompt="Do the thing.\n",
        earlier_files={"keep.txt": "keep"},
    )
    con = sqlite3.connect(wf / "db" / "db.sqlite")
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("INSERT INTO t VALUES (7, 'wal-row')")
    con.commit()
    for path in [wf, *wf.rglob("*"), crew, *crew.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)
    try:
        before = tree_digest(wf)
        started = time.monotonic()
        record = TestRun(wf, "step1", RunOptions(), backend=pods).execute()
        wall_s = time.monotonic() - started
        after = tree_digest(wf)
    finally:
        con.close()
    leftovers = [
        p.metadata.name
        for p in core.list_namespaced_pod(
            namespace, label_selector=f"{names.LABEL_RUN_ID}={record.id}"
        ).items
    ]
    attempts, stray = parse_attempts(pod_log(record))
    battery = Battery(record, attempts, stray, before, after, leftovers, wall_s)
    battery.extra["secret"] = secret
    return battery


def _egress(root: Path, pods: BackendFactory, outside: Outside) -> EgressRun:
    toml = EGRESS_TOML.replace(OUTSIDE_HOST, outside.ip)
    wf = write_workflow(
        root, command=["python3", "/workflow/code/step.py"], extra_toml=toml, db_sql=None
    )
    # The direct attempts keep the name: resolving it must fail (no DNS gets out).
    script = textwrap.dedent(THROUGH_PROXY).replace(OUTSIDE_HOST, outside.ip) + DIRECT_POD
    (wf / "code" / "step.py").write_text(script.replace("OUTSIDE_V4", outside.ip))
    before = tree_digest(wf)
    record = TestRun(wf, "step1", RunOptions(), backend=pods).execute()
    lines = call_lines(wf / "runs" / record.id / "test_mode_actions.jsonl")
    printed = json_lines(pod_log(record))
    out = next((d for d in printed if isinstance(d, dict) and "get" in d), {})
    direct = next((d for d in printed if isinstance(d, dict) and "tcp4" in d), {})
    same = tree_digest(wf) == before
    return EgressRun(record, out, direct, lines, outside.seen(), outside.ip, same)


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


def test_battery_run_finished_and_left_no_trace(
    runs: PodRuns, kube_cluster: Cluster, kube_core: Any, namespace: str
) -> None:
    battery = runs.battery
    assert battery.record.status is RunStatus.PASSED, (
        f"{battery.record.reason}; log: {battery.record.stderr.text[-800:]}"
    )
    assert battery.before == battery.after
    assert battery.leftovers == []
    assert not battery.record.stdout.truncated and not battery.record.stderr.truncated
    validated(battery.record, kube_cluster.node_names)
    assert not hostmount.mounts_below(battery.run_dir)


def test_battery_every_reported_attempt_is_asserted(runs: PodRuns) -> None:
    battery = runs.battery
    assert_attempts_match(battery, SAFE)


@pytest.mark.parametrize("name", attempt_params(SAFE, POD_KNOWN_HOLES))
def test_battery_attempt_is_contained(runs: PodRuns, name: str) -> None:
    battery = runs.battery
    check(battery, name, SAFE[name])


def test_battery_record_and_action_log_were_not_forged(runs: PodRuns) -> None:
    battery = runs.battery
    assert battery.action_lines() == []
    assert "ESCAPED" not in (battery.run_dir / "test_mode.json").read_text()


def test_battery_host_collector_never_read_through_the_traps(runs: PodRuns) -> None:
    battery = runs.battery
    secret: Path = battery.extra["secret"]
    assert battery.outcome("host-side traps planted").outcome == "planted"
    assert secret.read_text() == fs_battery.HOST_SECRET
    assert fs_battery.HOST_SECRET not in battery.record.model_dump_json()
    assert battery.record.db_diff is not None and battery.record.db_diff.error


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
    run = runs.egress
    record, out = run.record, run.out
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text[-2000:])
    validated(record, kube_cluster.node_names)
    assert run.digest_same
    assert_proxy_step_answers(out)

    # Only the reads (and the allowed tunnel) reached the outside server's Pod.
    http_seen = [(s["method"], s["path"]) for s in run.seen if s["proto"] == "http"]
    assert http_seen == [("GET", "/page"), ("HEAD", "/page")]
    assert [s["port"] for s in run.seen if s["proto"] == "tcp"] == [8443]

    egress = [ln for ln in run.lines if ln.tool == "http"]
    post = next(
        ln
        for ln in egress
        if ln.arguments["method"] == "POST" and ln.arguments["url"].endswith("/effect")
    )
    assert post.decision == "stub" and post.arguments["body_bytes"] == len(b"secret-payload-123")
    counts = record.egress[run.host]
    # Refused: the proxy's one, and the step's own non-HTTP TCP the firewall handed over.
    assert (counts.passed, counts.stubbed, counts.refused) == (3, 6, 2)
    assert counts.direct == 1
    assert record.egress["not-allowed.test"].stubbed == 1  # the host not listed, recorded


def test_egress_direct_connections_reach_the_guard_and_nothing_else(runs: PodRuns) -> None:
    """As on Docker: the step's own TCP is handed to the guard, which refuses what is
    neither HTTP nor TLS, closes it and records it (`via: direct`); its lookups are
    answered by the guard's DNS with the guard's own addresses; raw sockets and the
    firewall stay out of reach; the outside server sees none of it."""
    direct = runs.egress.direct
    assert direct["tcp4"] in ("OPEN: closed: 0 bytes", "OPEN: closed: reset"), direct
    refused = [
        ln for ln in runs.egress.lines if ln.tool == "http" and ln.arguments.get("method") == "TCP"
    ]
    assert len(refused) == 1 and refused[0].decision == "refuse", refused
    assert refused[0].detail["via"] == "direct"
    assert refused[0].detail["destination"] == f"{runs.egress.host}:8080"
    assert direct["raw"] == "PermissionError:EPERM"
    answers = direct["dns"]
    assert isinstance(answers, list) and answers, direct
    assert all(ip_address(a) in SYNTHETIC for a in answers), direct
    assert direct["iptables"] != 0
    assert not [s for s in runs.egress.seen if s.get("path") == "/direct"]
    assert not [s for s in runs.egress.seen if s.get("proto") == "tcp" and s["port"] == 8080]


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
