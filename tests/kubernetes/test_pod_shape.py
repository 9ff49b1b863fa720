"""The project's run shape as one Pod, on the real local cluster.

Built by hand here (the backend will build it from a RunPlan): an init container
with NET_ADMIN alone installs `sandbox.launch.firewall.rules()` in the Pod's network
namespace and exits; the guard sidecar (uid 10002, no capabilities) serves on
127.0.0.1:8790; the step (uid 10001, every capability dropped, no privilege
escalation, read-only root, the project's `seccomp/step.json` as a Localhost
profile, memory and CPU limits) reports what it can and cannot do. The fake outside
server is a Pod of its own on the same bridge; the guard reaching it is the proof
that the path exists, so the step failing to is the firewall's doing.
The step's end is seen through a watch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from sandbox.contracts import names
from sandbox.contracts.layout import GUARD_UID, STEP_UID
from sandbox.launch import firewall
from tests.kubernetes.pods import (
    OUTSIDE_PORT,
    container_state,
    locked_down,
    outside_server_pod,
    small,
    watch_pod,
)

# Room for a first build of the binaries when the fixture has to do it (make builds first).
pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(1200)]

GUARD_PORT = 8790
STEP_MEMORY = 256 * 1024 * 1024

STEP_SCRIPT = r"""
import ctypes, errno, json, os, socket, sys, time

result = {}
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp"):
    result[key] = status[key].strip()
result["uid"] = os.getuid()

def write(path):
    try:
        with open(path, "w") as f:
            f.write("written by the step\n")
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]

result["workflow_read"] = open("/workflow/workflow.toml").read()
result["workflow_write"] = write("/workflow/probe")
result["root_write"] = write("/probe")
result["group_write"] = write("/group/out.txt")

libc = ctypes.CDLL(None, use_errno=True)
# io_uring_setup(0, NULL): the project's profile refuses it (EPERM); the runtime's
# default profile lets it through to the kernel, which answers EFAULT or EINVAL.
rc = libc.syscall(425, 0, None)
result["io_uring_setup"] = errno.errorcode[ctypes.get_errno()] if rc < 0 else "allowed"

result["memory_limit"] = int(open("/sys/fs/cgroup/memory/memory.limit_in_bytes").read())

def http_get(host, port, timeout):
    s = socket.create_connection((host, port), timeout=timeout)
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    line = s.makefile("rb").readline().decode().strip()
    s.close()
    return line

deadline = time.monotonic() + 30
while True:
    try:
        result["guard"] = http_get("127.0.0.1", GUARD_PORT, 2)
        break
    except OSError as e:
        if time.monotonic() > deadline:
            result["guard"] = errno.errorcode.get(e.errno, str(e))
            break
        time.sleep(0.1)

start = time.monotonic()
try:
    result["outside"] = http_get(os.environ["OUTSIDE_IP"], int(os.environ["OUTSIDE_PORT"]), 5)
except OSError as e:
    result["outside"] = errno.errorcode.get(e.errno, type(e).__name__)
result["outside_s"] = round(time.monotonic() - start, 3)
print("RESULT " + json.dumps(result), flush=True)
""".replace("GUARD_PORT", str(GUARD_PORT))

GUARD_SCRIPT = r"""
import http.server, os, socket, time

# The guard's uid may leave: the outside server answering it proves the path exists.
deadline = time.monotonic() + 30
while True:
    try:
        s = socket.create_connection((os.environ["OUTSIDE_IP"], int(os.environ["OUTSIDE_PORT"])), timeout=2)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        print("GUARD-OUTSIDE " + s.makefile("rb").readline().decode().strip(), flush=True)
        s.close()
        break
    except OSError as e:
        if time.monotonic() > deadline:
            print("GUARD-OUTSIDE " + repr(e), flush=True)
            break
        time.sleep(0.2)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"guard\n")

http.server.ThreadingHTTPServer(("127.0.0.1", GUARD_PORT), Handler).serve_forever()
""".replace("GUARD_PORT", str(GUARD_PORT))


def firewall_script() -> str:
    lines = ["set -eu"]
    for tool, args in firewall.rules().items():
        lines += [f"{tool}-restore -w <<'RULES'", firewall.restore_input(args), "RULES"]
    lines += ["iptables -w -S OUTPUT", "ip6tables -w -S OUTPUT"]
    return "\n".join(lines) + "\n"


def run_pod(group: Path, workflow: Path, outside_ip: str, seccomp_profile: str) -> dict[str, Any]:
    env = [
        {"name": "OUTSIDE_IP", "value": outside_ip},
        {"name": "OUTSIDE_PORT", "value": str(OUTSIDE_PORT)},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]
    firewall_context = locked_down(0)
    firewall_context["capabilities"] = {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "run", "labels": {"sandbox.test": "pod-shape"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "initContainers": [
                {
                    "name": "firewall",
                    "image": names.GUARD_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", firewall_script()],
                    "securityContext": firewall_context,
                    "resources": small(),
                }
            ],
            "containers": [
                {
                    "name": "guard",
                    "image": names.GUARD_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", GUARD_SCRIPT],
                    "env": env,
                    "securityContext": locked_down(GUARD_UID),
                    "resources": small(),
                },
                {
                    "name": "step",
                    "image": names.STEP_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", STEP_SCRIPT],
                    "env": env,
                    "securityContext": locked_down(
                        STEP_UID, {"type": "Localhost", "localhostProfile": seccomp_profile}
                    ),
                    "resources": {
                        "limits": {"cpu": "500m", "memory": str(STEP_MEMORY)},
                        "requests": {"cpu": "100m", "memory": str(STEP_MEMORY)},
                    },
                    "volumeMounts": [
                        {"name": "group", "mountPath": "/group"},
                        {"name": "workflow", "mountPath": "/workflow", "readOnly": True},
                    ],
                },
            ],
            "volumes": [
                {"name": "group", "hostPath": {"path": str(group), "type": "Directory"}},
                {"name": "workflow", "hostPath": {"path": str(workflow), "type": "Directory"}},
            ],
        },
    }


def test_the_run_pod_holds_its_step_to_the_project_shape(
    kube_cluster: Any, kube_core: Any, kube_namespace: str, tmp_path: Path, capsys: Any
) -> None:
    workflow = tmp_path / "workflow"
    workflow.mkdir()
    (workflow / "workflow.toml").write_text('name = "wf"\n')
    workflow_before = {p.name: p.read_bytes() for p in workflow.iterdir()}
    group = tmp_path / "group"
    group.mkdir()
    os.chown(group, STEP_UID, STEP_UID)

    outside = kube_core.create_namespaced_pod(kube_namespace, outside_server_pod())
    outside = watch_pod(
        kube_core,
        kube_namespace,
        "outside",
        outside.metadata.resource_version,
        lambda p: p.status.pod_ip and getattr(container_state(p, "server"), "running", None),
    )

    started = time.monotonic()
    created = kube_core.create_namespaced_pod(
        kube_namespace, run_pod(group, workflow, outside.status.pod_ip, "step.json")
    )
    pod = watch_pod(
        kube_core,
        kube_namespace,
        "run",
        created.metadata.resource_version,
        lambda p: getattr(container_state(p, "step"), "terminated", None) is not None,
    )
    elapsed = time.monotonic() - started
    with capsys.disabled():
        print(
            f"\nPod create -> step end: {elapsed:.2f} s (init + guard + step, node {pod.spec.node_name})"
        )

    assert pod.spec.node_name in kube_cluster.node_names
    step_log = kube_core.read_namespaced_pod_log("run", kube_namespace, container="step")
    guard_log = kube_core.read_namespaced_pod_log("run", kube_namespace, container="guard")
    init_log = kube_core.read_namespaced_pod_log("run", kube_namespace, container="firewall")
    assert container_state(pod, "step").terminated.exit_code == 0, step_log

    readback = [line for line in init_log.splitlines() if line.startswith("-")]
    assert readback == firewall.expected_readback()

    result = json.loads(
        next(line for line in step_log.splitlines() if line.startswith("RESULT "))[7:]
    )
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(result[key], 16) == 0, (key, result[key])
    assert result["NoNewPrivs"] == "1"
    assert result["Seccomp"] == "2"
    assert result["uid"] == STEP_UID
    assert result["io_uring_setup"] == "EPERM", "the Localhost profile is not the one applied"
    assert result["memory_limit"] == STEP_MEMORY

    assert result["workflow_read"] == 'name = "wf"\n'
    assert result["workflow_write"] == "EROFS"
    assert result["root_write"] == "EROFS"
    assert result["group_write"] == "ok"
    assert (group / "out.txt").read_text() == "written by the step\n"
    assert (group / "out.txt").stat().st_uid == STEP_UID
    assert {p.name: p.read_bytes() for p in workflow.iterdir()} == workflow_before

    assert result["guard"] == "HTTP/1.0 200 OK"
    assert "GUARD-OUTSIDE HTTP/1.0 200 OK" in guard_log, guard_log
    # REJECT with tcp-reset: refused at once, never a hang.
    assert result["outside"] == "ECONNREFUSED", result
    assert result["outside_s"] < 2, result
