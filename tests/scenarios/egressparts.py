"""What the egress scenarios share: one step run against the fake outside server with
its record, answer and action lines; the through-the-proxy step and what it must be
answered on any backend; a fake outside DNS server that counts what reaches it. A
helper, not a test module, so no test file imports another."""

from __future__ import annotations

import contextlib
import json
import secrets
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from docker import DockerClient
from docker.models.containers import Container

from sandbox.contracts.names import STEP_IMAGE
from sandbox.contracts.record import TestRunRecord
from sandbox.contracts.wire import ActionLine
from sandbox.policy import stub_reply
from sandbox.run.testrun import RunOptions, TestRun
from tests.conftest import WorkflowFactory, call_lines, tree_digest
from tests.fakes.harness import Outside
from tests.polling import wait_for


def run_step(
    make_workflow: WorkflowFactory,
    outside: Outside,
    source: str,
    egress_toml: str,
    *,
    timeout_s: float = 60,
) -> tuple[TestRunRecord, dict[str, Any], list[ActionLine]]:
    wf = make_workflow(
        command=["python3", "/workflow/code/step.py"],
        extra_toml=egress_toml,
        db_sql=None,
        timeout_s=timeout_s,
    )
    script = textwrap.dedent(source).replace("OUTSIDE_V4", outside.ipv4)
    (wf / "code" / "step.py").write_text(script.replace("OUTSIDE_V6", outside.ipv6))
    before = tree_digest(wf)
    record = TestRun(wf, "step1", RunOptions(upstream_networks=(outside.network,))).execute()
    assert tree_digest(wf) == before
    # One line a call; each forwarded request's start line has its outcome after it.
    lines = call_lines(wf / "runs" / record.id / "test_mode_actions.jsonl")
    out = json.loads(record.stdout.text.strip().splitlines()[-1]) if record.stdout.text else {}
    return record, out, lines


THROUGH_PROXY = """
import json, subprocess, urllib.request, urllib.error
out = {}
def fetch(method, url, body=None):
    req = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
out["get"] = fetch("GET", "http://outside.test:8080/page")
out["head"] = fetch("HEAD", "http://outside.test:8080/page")
for m in ("POST", "PUT", "PATCH", "DELETE"):
    out[m] = fetch(m, "http://outside.test:8080/effect", b"secret-payload-123")
out["other_host"] = fetch("GET", "http://not-allowed.test:8080/x")
out["wrong_port"] = fetch("GET", "http://outside.test:9090/x")
out["websocket"] = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
    "-H", "Upgrade: websocket", "-H", "Connection: Upgrade", "http://outside.test:8080/ws"],
    capture_output=True, text=True).stdout
out["connect_allowed"] = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_connect}",
    "--max-time", "5", "https://outside.test:8443/"], capture_output=True, text=True).stdout
out["connect_denied"] = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_connect}",
    "--max-time", "5", "https://outside.test:8080/"], capture_output=True, text=True).stdout
print(json.dumps(out))
"""

EGRESS_TOML = """
[egress]
allow = [
  { host = "outside.test", port = 8080 },
  { host = "outside.test", port = 8443, tls = true, inspect = false },
]
"""


def assert_proxy_step_answers(out: dict[str, Any]) -> None:
    """What THROUGH_PROXY's step must have been answered, on any backend: reads pass,
    every other method is stubbed with the stub text, other hosts, ports, upgrades and
    tunnels are refused."""
    assert out["get"] == [200, "hello from outside /page"]
    assert out["head"] == [200, ""]
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        status, body = out[method]
        assert status == 403
        assert body.strip() == stub_reply(
            f"HTTP {method}", f"HTTP {method} can have effects; only GET and HEAD pass"
        )
    assert out["other_host"][0] == 403 and "not on the egress allow list" in out["other_host"][1]
    assert out["wrong_port"][0] == 403
    assert out["websocket"] == "403"
    assert out["connect_allowed"] == "200"
    assert out["connect_denied"] == "403"  # 8080 is a plain-HTTP port: no blind tunnel to it


@dataclass(frozen=True)
class Resolver:
    ipv4: str
    container: Container

    def queries(self) -> list[str]:
        return [ln for ln in self.container.logs().decode().splitlines() if ln.startswith("query")]


RESOLVER = r"""
import socket, threading, sys
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 53))
    while True:
        data, peer = s.recvfrom(4096); print("query udp", len(data), flush=True)
def tcp():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 53)); s.listen(8)
    while True:
        c, _ = s.accept(); print("query tcp", len(c.recv(4096)), flush=True); c.close()
threading.Thread(target=tcp, daemon=True).start()
print("ready", flush=True)
udp()
"""


@contextlib.contextmanager
def fake_resolver(client: DockerClient, network: str) -> Iterator[Resolver]:
    """A fake outside DNS server on the outside network that counts what reaches it."""
    container = client.containers.run(
        STEP_IMAGE,
        ["python3", "-c", RESOLVER],
        name=f"sandbox-fake-resolver-{secrets.token_hex(4)}",
        user="10001:10001",
        labels={"sandbox.fake": "1"},
        sysctls={"net.ipv4.ip_unprivileged_port_start": "0"},
        network=network,
        detach=True,
    )
    try:
        container.reload()
        ipv4 = container.attrs["NetworkSettings"]["Networks"][network]["IPAddress"]
        wait_for(lambda: b"ready" in container.logs(), 30, "the fake resolver")
        yield Resolver(ipv4, container)
    finally:
        container.remove(force=True)
