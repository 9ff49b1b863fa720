"""The escape battery and the egress step on a Pod, for the runner on this host and the fleet.

The step programs are the Docker suite's own: the file, mount, /proc, privilege and
device battery of `tests/security/filesystemparts.py` (with a few attempts only a
Pod offers: a service-account token, the kubelet's files in the container, the
node's containerd socket, the kubelet's port), and the egress step of
`tests/scenarios/egressparts.py` with the fake outside server
(`tests/fakes/outside_server.py`) in a Pod of its own, named by its address (a Pod
has no Docker network alias). `test_checks_on_pods.py` runs them with the runner on
this host, `test_fleet_checks.py` through the fleet on each node: both build the
workflows, read the results and assert them here, so the two cannot drift apart.

Where the runner sees the folders differently from this process (a fleet's runner
sees the claim at `/claim`), `seen_root` names this process's `root` as the runner
sees it: the battery's host-side traps and its Crew folder point there, and every
result is read from this process's own view of the workflow.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import jsonschema
from kubernetes import client

from sandbox.contracts import names
from sandbox.contracts.record import SCHEMA_PATH, RunStatus, TestRunRecord, read_record
from sandbox.contracts.wire import ActionLine
from sandbox.guard.egress.dns import SYNTHETIC_V4 as SYNTHETIC
from sandbox.hostfs import hostmount
from testbed.kubernetes.cluster import Cluster
from tests.conftest import call_lines, tree_digest, write_workflow
from tests.kubernetes.pods import http_get_in, server_pod, start_server
from tests.paths import TESTS
from tests.scenarios.egressparts import EGRESS_TOML, THROUGH_PROXY, assert_proxy_step_answers
from tests.security import filesystemparts as fs_battery
from tests.security.conftest import Battery, build_workflow, check, parse_attempts

FAKES = TESTS / "fakes"
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


def validated(record: TestRunRecord, nodes: list[str], wf: Path | None = None) -> TestRunRecord:
    """The record on disk (in `wf`, this process's view; else the record's own folder)
    is the one returned, valid against the published schema, and names a node of the
    cluster."""
    run_dir = Path(wf or record.workflow_dir) / "runs" / record.id
    raw = json.loads((run_dir / "test_mode.json").read_text())
    jsonschema.validate(raw, json.loads(SCHEMA_PATH.read_text()))
    assert read_record(run_dir) == record
    assert record.backend == "kubernetes" and record.node in nodes, (record.backend, record.node)
    return record


# --- the outside server ------------------------------------------------------------


@dataclass
class Outside:
    """The fake outside server's Pod: its address, and what reached it."""

    core: Any
    namespace: str
    name: str
    ip: str

    def seen(self) -> list[dict[str, Any]]:
        body = http_get_in(self.core, self.namespace, self.name, "http://127.0.0.1:8080/__seen")
        return list(json.loads(body))


@contextmanager
def outside_server(
    kube_cluster: Cluster, core: Any, namespace: str, folder: Path, name: str = "outside"
) -> Iterator[Outside]:
    """The fake outside server in a Pod named `name`, its code in `folder` (created)."""
    folder.mkdir()
    shutil.copy(FAKES / "outside_server.py", folder / "outside_server.py")
    manifest = server_pod(name, ["python3", "/srv/outside_server.py"], {"/srv": folder})
    ip = start_server(core, namespace, manifest)
    # An exec swaps its client's request method while it runs: a client of its own, so
    # a run's thread never sends a plain call down the exec's websocket.
    api = kube_cluster.api_client()
    server = Outside(client.CoreV1Api(api), namespace, name, ip)
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


# --- the escape battery ------------------------------------------------------------


@dataclass
class PodBattery(Battery):
    """A battery whose run folder is read from this process's view of the workflow."""

    workflow: Path = Path()

    @property
    def run_dir(self) -> Path:
        return self.workflow / "runs" / self.record.id


@dataclass
class BatteryWorkflow:
    """The battery's workflow as built, before its run."""

    wf: Path
    secret: Path
    before: dict[str, str]


@contextmanager
def battery_workflow(
    root: Path, containerd_socket: str, seen_root: Path | None = None
) -> Iterator[BatteryWorkflow]:
    """The Docker battery's workflow (WAL DB kept open for the run, Crew folder, prompt,
    world-writable files), its step with the Pod's own attempts. The host-side traps
    and the Crew folder name `root` as the runner sees it (`seen_root`)."""
    seen = seen_root or root
    crew = root / "crew-a"
    crew.mkdir()
    (crew / "crew.txt").write_text("crew data")
    secret = root / "host-secret.txt"
    secret.write_text(fs_battery.HOST_SECRET)
    step = fs_battery.STEP.replace("@@HOST_SECRET_PATH@@", str(seen / secret.name))
    # The kubelet's termination-message file is in every container's /dev (its own
    # attempt below says what the step can do with it).
    step = step.replace('SAFE_DEV = {"null",', 'SAFE_DEV = {"termination-log", "null",', 1)
    assert "termination-log" in step
    pod_step = POD_STEP.replace("@@CONTAINERD_SOCKET@@", containerd_socket)
    step += pod_step.replace("@@KUBELET_PORT@@", str(KUBELET_PORT))
    wf = build_workflow(
        root,
        step,
        extra_toml=f'[[crew_folders]]\nname = "a"\npath = "{seen / crew.name}"\n',
        prompt="Do the thing.\n",
        earlier_files={"keep.txt": "keep"},
    )
    con = sqlite3.connect(wf / "db" / "db.sqlite")
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA wal_autocheckpoint=0")
        con.execute("INSERT INTO t VALUES (7, 'wal-row')")
        con.commit()
        for path in [wf, *wf.rglob("*"), crew, *crew.rglob("*")]:
            path.chmod(0o777 if path.is_dir() else 0o666)
        yield BatteryWorkflow(wf, secret, tree_digest(wf))
    finally:
        con.close()


def battery_of(
    built: BatteryWorkflow, record: TestRunRecord, core: Any, namespace: str, wall_s: float
) -> PodBattery:
    """The battery's evidence once its run ended (the workflow's DB still open)."""
    after = tree_digest(built.wf)
    leftovers = [
        p.metadata.name
        for p in core.list_namespaced_pod(
            namespace, label_selector=f"{names.LABEL_RUN_ID}={record.id}"
        ).items
    ]
    attempts, stray = parse_attempts(pod_log(record))
    battery = PodBattery(
        record, attempts, stray, built.before, after, leftovers, wall_s, workflow=built.wf
    )
    battery.extra["secret"] = built.secret
    return battery


def assert_battery_finished_without_trace(battery: PodBattery, nodes: list[str]) -> None:
    assert battery.record.status is RunStatus.PASSED, (
        f"{battery.record.reason}; log: {battery.record.stderr.text[-800:]}"
    )
    assert battery.before == battery.after
    assert battery.leftovers == []
    assert not battery.record.stdout.truncated and not battery.record.stderr.truncated
    validated(battery.record, nodes, battery.workflow)
    assert not hostmount.mounts_below(battery.run_dir)


def assert_battery_not_forged(battery: Battery) -> None:
    assert battery.action_lines() == []
    assert "ESCAPED" not in (battery.run_dir / "test_mode.json").read_text()


def assert_battery_traps_held(battery: Battery) -> None:
    """The host-side collector never read through the links the step planted."""
    secret: Path = battery.extra["secret"]
    assert battery.outcome("host-side traps planted").outcome == "planted"
    assert secret.read_text() == fs_battery.HOST_SECRET
    assert fs_battery.HOST_SECRET not in battery.record.model_dump_json()
    assert battery.record.db_diff is not None and battery.record.db_diff.error


def battery_escapes(battery: Battery) -> list[str]:
    """Every attempt of SAFE not in a safe outcome (or not reported), one line each."""
    found = []
    for name, safe in SAFE.items():
        try:
            check(battery, name, safe)
        except AssertionError as exc:
            found.append(str(exc).splitlines()[0])
    return found


# --- egress ------------------------------------------------------------------------

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
    wf: Path


def egress_workflow(root: Path, outside: Outside) -> Path:
    """The egress step's workflow, its allow list naming the outside server's Pod."""
    toml = EGRESS_TOML.replace(OUTSIDE_HOST, outside.ip)
    wf = write_workflow(
        root, command=["python3", "/workflow/code/step.py"], extra_toml=toml, db_sql=None
    )
    # The direct attempts keep the name: resolving it must fail (no DNS gets out).
    script = textwrap.dedent(THROUGH_PROXY).replace(OUTSIDE_HOST, outside.ip) + DIRECT_POD
    (wf / "code" / "step.py").write_text(script.replace("OUTSIDE_V4", outside.ip))
    return wf


def egress_of(
    wf: Path, before: dict[str, str], record: TestRunRecord, outside: Outside
) -> EgressRun:
    """The egress run's evidence, read from this process's view of `wf`."""
    lines = call_lines(wf / "runs" / record.id / "test_mode_actions.jsonl")
    printed = json_lines(pod_log(record))
    out = next((d for d in printed if isinstance(d, dict) and "get" in d), {})
    direct = next((d for d in printed if isinstance(d, dict) and "tcp4" in d), {})
    same = tree_digest(wf) == before
    return EgressRun(record, out, direct, lines, outside.seen(), outside.ip, same, wf)


def assert_egress_reads_pass_writes_stubbed(run: EgressRun, nodes: list[str]) -> None:
    """Reads reached the outside server, writes were stubbed and recorded, other
    hosts refused; the workflow folder unchanged."""
    record, out = run.record, run.out
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text[-2000:])
    validated(record, nodes, run.wf)
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


def assert_direct_reaches_only_the_guard(run: EgressRun) -> None:
    """As on Docker: the step's own TCP is handed to the guard, which refuses what is
    neither HTTP nor TLS, closes it and records it (`via: direct`); its lookups are
    answered by the guard's DNS with the guard's own addresses; raw sockets and the
    firewall stay out of reach; the outside server sees none of it."""
    direct = run.direct
    assert direct["tcp4"] in ("OPEN: closed: 0 bytes", "OPEN: closed: reset"), direct
    refused = [ln for ln in run.lines if ln.tool == "http" and ln.arguments.get("method") == "TCP"]
    assert len(refused) == 1 and refused[0].decision == "refuse", refused
    assert refused[0].detail["via"] == "direct"
    assert refused[0].detail["destination"] == f"{run.host}:8080"
    assert direct["raw"] == "PermissionError:EPERM"
    answers = direct["dns"]
    assert isinstance(answers, list) and answers, direct
    assert all(ip_address(a) in SYNTHETIC for a in answers), direct
    assert direct["iptables"] != 0
    assert not [s for s in run.seen if s.get("path") == "/direct"]
    assert not [s for s in run.seen if s.get("proto") == "tcp" and s["port"] == 8080]
