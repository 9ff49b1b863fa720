"""What is neither TCP over IPv4 nor DNS, against the real engine: UDP and anything over
IPv6 is refused at once, nothing reaches the fake outside server, and each attempt is
on the record (destination, port, protocol, count)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from docker import DockerClient

from sandbox.contracts.record import RunStatus
from tests.conftest import WorkflowFactory
from tests.fakes.harness import Outside, outside_server
from tests.scenarios.egressparts import run_step

pytestmark = pytest.mark.engine

EGRESS_TOML = """
[egress]
allow = [{ host = "outside.test", port = 8080 }]
"""

STEP = r"""
import json, socket, time
out = {}
def attempt(fn):
    started = time.monotonic()
    try:
        fn()
        result = "sent"
    except OSError as exc:
        result = type(exc).__name__
    return [result, round(time.monotonic() - started, 3)]
def udp(family, host, port, times):
    def send():
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            for _ in range(times):
                s.sendto(b"secret-datagram", (host, port))
    return send
def udp_connected(family, host, port):
    def send():
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.settimeout(10)
            s.connect((host, port))
            s.send(b"secret-datagram")
            s.recv(100)
    return send
def tcp6(host, port):
    def connect():
        socket.create_connection((host, port), timeout=10).close()
    return connect
out["udp4"] = attempt(udp(socket.AF_INET, "OUTSIDE_V4", 9999, 3))
out["udp4_connected"] = attempt(udp_connected(socket.AF_INET, "OUTSIDE_V4", 9999))
out["udp6"] = attempt(udp(socket.AF_INET6, "OUTSIDE_V6", 9999, 1))
out["tcp6"] = attempt(tcp6("OUTSIDE_V6", 8080))
print(json.dumps(out))
"""


@pytest.fixture
def outside(engine: DockerClient) -> Iterator[Outside]:
    with outside_server(engine) as server:
        yield server


def test_udp_and_ipv6_are_refused_at_once_and_recorded(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    record, out, lines = run_step(make_workflow, outside, STEP, EGRESS_TOML)
    assert record.status is RunStatus.PASSED, record.stderr.text
    # Refused, not dropped: each fails with an error, never a timeout (10 s each).
    for key in ("udp4", "udp4_connected", "udp6", "tcp6"):
        assert out[key][0] in ("PermissionError", "ConnectionRefusedError"), (key, out)
    # Nothing arrived: the fake outside server records every datagram and connection.
    assert outside.seen() == []
    listed = {(p.protocol, p.destination, p.port): p.count for p in record.packets.destinations}
    assert listed.get(("udp", outside.ipv4, 9999), 0) >= 2, listed
    assert listed.get(("udp", outside.ipv6, 9999)) == 1, listed
    assert listed.get(("tcp", outside.ipv6, 8080), 0) >= 1, listed
    assert record.packets.attempts >= 4
    assert "refused packets:" in "\n".join(record.summary_lines())
    packet_lines = [ln for ln in lines if ln.tool == "packet"]
    assert packet_lines and all(ln.decision == "refuse" for ln in packet_lines)
    # The guard's own connections and the preflight's probes are not the step's.
    assert all(ln.detail.get("uid") != 10002 for ln in packet_lines)
