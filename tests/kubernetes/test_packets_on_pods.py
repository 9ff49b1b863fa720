"""What is neither TCP over IPv4 nor DNS, on a Pod as on Docker: a step's UDP to an
outside server Pod's address is refused at once, nothing arrives, and each attempt is on
the record (destination, port). The Pod's guard starts as Docker's guard entry does (root
with the entry's capabilities), binds the firewall's log group and drops every
capability before its code runs: read from the node, each process of the running guard's
container holds none."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from sandbox.backends import BackendFactory
from sandbox.contracts.layout import GUARD_UID
from sandbox.contracts.record import RunStatus
from tests.conftest import ThreadedRun, tree_digest, write_workflow
from tests.kubernetes.pods import (
    exec_in,
    no_pods_or_secrets,
    pod_of,
    proc_status,
    server_pod,
    start_server,
)

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

UDP_PORT = 9999

# Every datagram that arrives is printed (the Pod's log is what arrived).
LISTENER = f"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", {UDP_PORT}))
print("listening", flush=True)
while True:
    data, peer = s.recvfrom(2048)
    print("DATAGRAM", peer[0], data.decode(errors="replace"), flush=True)
"""

STEP = r"""
import json, os, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
out = {}
def attempt(fn):
    try:
        fn()
        return "sent"
    except OSError as exc:
        return type(exc).__name__
def udp():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(3):
            s.sendto(b"secret-datagram", (host, port))
def udp_connected():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(10)
        s.connect((host, port))
        s.send(b"secret-datagram")
        s.recv(100)
out["udp"] = attempt(udp)
out["udp_connected"] = attempt(udp_connected)
print("OUT " + json.dumps(out), flush=True)
open("ready", "w").close()
deadline = time.monotonic() + 240
while not os.path.exists("go") and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _guard_container_processes(pod_uid: str) -> list[psutil.Process]:
    """Every process on the node in the guard's container, of any uid: those of the
    Pod's cgroups (by the Pod's uid, never by name) in the mount namespace of the
    guard's uid (each container has its own)."""
    marker = "pod" + pod_uid
    in_pod = []
    for proc in psutil.process_iter():
        try:
            if marker in Path(f"/proc/{proc.pid}/cgroup").read_text():
                in_pod.append((proc, os.readlink(f"/proc/{proc.pid}/ns/mnt")))
        except (OSError, psutil.Error):
            continue
    guards = {mnt for proc, mnt in in_pod if proc.uids().real == GUARD_UID}
    assert len(guards) == 1, f"the guard's uid runs in {len(guards)} mount namespaces"
    return [proc for proc, mnt in in_pod if mnt in guards]


def test_udp_from_a_pod_is_refused_and_recorded_and_the_guard_holds_no_capability(
    kube_core: Any, kube_namespace: str, pods: BackendFactory, node_dir: Path
) -> None:
    outside_ip = start_server(
        kube_core, kube_namespace, server_pod("outside", ["python3", "-c", LISTENER], {})
    )
    wf = write_workflow(
        node_dir,
        command=["python3", "/workflow/code/step.py", outside_ip, str(UDP_PORT)],
        timeout_s=300,
        db_sql=None,
    )
    (wf / "code" / "step.py").write_text(STEP)
    before = tree_digest(wf)
    with ThreadedRun(wf, backend=pods) as run:
        ready = run.wait_for_in_group("ready")
        pod = pod_of(kube_core, kube_namespace, run.layout.run_id)
        procs = _guard_container_processes(pod.metadata.uid)
        # tini and the guard (the entry's shell and nflog helper exec'd into them).
        assert len(procs) >= 2, procs
        for proc in procs:
            status = proc_status(proc.pid)
            # The entry's moment as root is over: every process is the guard's uid...
            assert status["Uid"].split() == [str(GUARD_UID)] * 4, (proc.pid, status["Uid"])
            # ...with no capability in any set, the bounding set included.
            for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                assert int(status[key], 16) == 0, (proc.pid, key, status[key])
            assert status["NoNewPrivs"].strip() == "1"
            # Not the runner's (this host's) network namespace: the Pod's.
            assert os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        (ready.parent / "go").touch()
    record = run.record
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    assert record.preflight is not None and record.preflight.ok, record.preflight
    line = next(ln for ln in record.stderr.text.splitlines() + record.stdout.text.splitlines()
                if ln.startswith("OUT "))  # fmt: skip
    out = json.loads(line[4:])
    # Refused at once, never a timeout (10 s for the connected socket's reply).
    assert out["udp"] in ("PermissionError", "ConnectionRefusedError"), out
    assert out["udp_connected"] in ("PermissionError", "ConnectionRefusedError"), out
    listed = {(p.protocol, p.destination, p.port): p.count for p in record.packets.destinations}
    assert listed.get(("udp", outside_ip, UDP_PORT), 0) >= 2, listed
    assert record.packets.attempts >= 2
    assert "refused packets:" in "\n".join(record.summary_lines())
    # Nothing arrived, though the listener takes what is sent to it (sent from its own
    # Pod at the end, so its log holds one datagram: that one).
    exec_in(
        kube_core,
        kube_namespace,
        "outside",
        [
            "python3",
            "-c",
            "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
            f".sendto(b'control', ({outside_ip!r}, {UDP_PORT}))",
        ],
    )
    served = _log_with(kube_core, kube_namespace, "DATAGRAM")
    assert [ln for ln in served.splitlines() if ln.startswith("DATAGRAM")] == [
        f"DATAGRAM {outside_ip} control"
    ], served
    assert tree_digest(wf) == before
    no_pods_or_secrets(kube_core, kube_namespace)


def _log_with(core: Any, namespace: str, text: str, deadline_s: float = 30) -> str:
    """The outside Pod's log once it holds `text` (the control datagram is in flight)."""
    end = time.monotonic() + deadline_s
    while True:
        log = str(core.read_namespaced_pod_log("outside", namespace))
        if text in log or time.monotonic() > end:
            return log
        time.sleep(0.1)
