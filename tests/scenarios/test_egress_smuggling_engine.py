"""Request smuggling through the egress proxy, against the real engine.

The step sends hand-made requests to the proxy, in plain HTTP and inside an
inspected TLS tunnel, to an allow-listed raw server (in its own container) that
records every byte each connection brings. Whatever the step tries, nothing but
the allowed GETs arrives, each byte for byte as the guard logged it, and every
request the step sent has its own line in the action log.
"""

from __future__ import annotations

import hashlib
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.contracts.record import RunStatus
from sandbox.run.testrun import RunOptions, TestRun
from tests.conftest import WorkflowFactory, call_lines, tree_digest
from tests.fakes.harness import Outside, outside_server
from tests.polling import wait_for

pytestmark = pytest.mark.engine

# Each case: a name, the request bytes after the request line's target (the step adds
# the line), the status the proxy must answer, and how many requests it holds.
# `{T}` is the request line's start, `{H}` the correct Host header line.
CASES: list[tuple[str, str, int, int]] = [
    (
        "bare LF ends a header value",
        "{T}\r\n{H}\r\nX-Smuggle: a\nContent-Length: 35\r\n\r\n"
        "POST /smuggled HTTP/1.1\r\nX: 1234567\r\n\r\n",
        400,
        1,
    ),
    (
        "bare LF inside a header name line",
        "{T}\r\n{H}\r\nX-Bad\nDELETE /smuggled HTTP/1.1: x\r\n\r\n",
        400,
        1,
    ),
    ("bare CR in a header value", "{T}\r\n{H}\r\nX-A: a\rDELETE /x\r\n\r\n", 400, 1),
    ("bare CR in a header name", "{T}\r\n{H}\r\nX-\rA: b\r\n\r\n", 400, 1),
    ("bare CR ends the request line", "{T}\r{H}\r\n\r\n", 400, 1),
    ("only bare LFs", "{T}\n{H}\n\n", 400, 1),
    ("obs-fold", "{T}\r\n{H}\r\nX-A: a\r\n Content-Length: 5\r\n\r\nhello", 400, 1),
    ("obs-fold with a tab", "{T}\r\n{H}\r\nX-A: a\r\n\tb\r\n\r\n", 400, 1),
    (
        "Content-Length and Transfer-Encoding",
        "{T}\r\n{H}\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        "0\r\n\r\nPOST /smuggled HTTP/1.1\r\n\r\n",
        400,
        1,
    ),
    (
        "duplicate Content-Length",
        "{T}\r\n{H}\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n",
        400,
        1,
    ),
    (
        "conflicting Content-Length",
        "{T}\r\n{H}\r\nContent-Length: 0\r\nContent-Length: 41\r\n\r\n"
        "POST /smuggled HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
        400,
        1,
    ),
    ("Content-Length with a sign", "{T}\r\n{H}\r\nContent-Length: +0\r\n\r\n", 400, 1),
    (
        "chunked on a GET",
        "{T}\r\n{H}\r\nTransfer-Encoding: chunked\r\n\r\n"
        "2c\r\nPOST /smuggled HTTP/1.1\r\nContent-Length: 0\r\n\r\n\r\n0\r\n\r\n",
        400,
        1,
    ),
    (
        "a Transfer-Encoding h11 does not know",
        "{T}\r\n{H}\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        400,
        1,
    ),
    ("space before a header colon", "{T}\r\n{H}\r\nTransfer-Encoding : chunked\r\n\r\n", 400, 1),
    ("a NUL in a header value", "{T}\r\n{H}\r\nX-A: a\x00b\r\n\r\n", 400, 1),
    ("Host that disagrees", "{T}\r\nHost: badhost.test\r\n\r\n", 400, 1),
    ("two Host headers", "{T}\r\n{H}\r\nHost: badhost.test\r\n\r\n", 400, 1),
    ("a head too large", "{T}\r\n{H}\r\nX-Big: " + "a" * 70000 + "\r\n\r\n", 431, 1),
    (
        "pipelined: a GET, then a POST",
        "{T}\r\n{H}\r\n\r\nPOST {P}/smuggled HTTP/1.1\r\n{H}\r\nContent-Length: 5\r\n\r\nhello",
        403,
        2,
    ),
    ("the allowed GET", "{T}\r\n{H}\r\nX-Client: battery\r\nConnection: close\r\n\r\n", 200, 1),
]

# Targets that try to leave for another host: (name, plain request line, TLS request
# line, Host header or None for the allowed one, plain status, TLS status).
TARGETS: list[tuple[str, str, str, str | None, int, int]] = [
    (
        "absolute form to another host, its own Host",
        "GET http://badhost.test/x",
        "GET http://badhost.test/x",
        "badhost.test",
        403,  # plain: a host not on the list, a stub
        400,
    ),
    (
        "absolute form to another host, the allowed Host",
        "GET http://badhost.test/x",
        "GET https://badhost.test/x",
        None,
        400,
        400,
    ),
    (
        "userinfo",
        "GET http://outside.test:8082@badhost.test/x",
        "GET @badhost.test/x",
        None,
        400,
        400,
    ),
    (
        "a fragment, or https to another host",
        "GET http://outside.test:8082/x#@badhost.test",
        "GET https://badhost.test:8445/x",
        None,
        400,
        400,
    ),
    ("HTTP/2 prior knowledge", "PRI *", "PRI *", None, 505, 505),
]

STEP = r"""
import json, os, re, socket, ssl
cases = json.load(open("/workflow/code/cases.json"))
proxy = ("127.0.0.1", 8792)

def read_all(sock):
    data = b""
    sock.settimeout(15)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionError, ssl.SSLError):
        pass
    return data

def statuses(data):
    return [int(code) for code in re.findall(rb"HTTP/1\.1 ([0-9]{3}) ", data)]

def send(sock, payload):
    try:
        sock.sendall(payload)
    except OSError:  # the proxy may refuse and close before it read everything
        pass

def plain(payload):
    with socket.create_connection(proxy) as s:
        send(s, payload)
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        return read_all(s)

def tunnel(payload):
    with socket.create_connection(proxy) as s:
        s.sendall(b"CONNECT outside.test:8445 HTTP/1.1\r\nHost: outside.test:8445\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(1)
        assert head.startswith(b"HTTP/1.1 200"), head
        context = ssl.create_default_context()
        with context.wrap_socket(s, server_hostname="outside.test") as t:
            send(t, payload)
            return read_all(t)

out = []
for name, mode, payload in cases:
    data = (plain if mode == "plain" else tunnel)(payload.encode("latin-1"))
    out.append([name, mode, statuses(data), data.decode("latin-1")[-300:]])
with open("out.json", "w") as handle:  # in the group folder (stdout keeps a tail only)
    json.dump(out, handle)
"""


@pytest.fixture
def outside(engine: DockerClient) -> Iterator[Outside]:
    with outside_server(engine) as server:
        yield server


def _payloads() -> list[tuple[str, str, str, list[int]]]:
    """(name, mode, request bytes, expected statuses) for every case, plain and in TLS."""
    out: list[tuple[str, str, str, list[int]]] = []
    for mode, prefix, host in (
        ("plain", "http://outside.test:8082", "outside.test:8082"),
        ("tls", "", "outside.test:8445"),
    ):
        for name, template, status, requests in CASES:
            payload = (
                template.replace("{T}", f"GET {prefix}/ok-{len(out)} HTTP/1.1")
                .replace("{H}", f"Host: {host}")
                .replace("{P}", prefix)
            )
            expected = [200, status] if requests == 2 else [status]
            out.append((name, mode, payload, expected))
        for name, plain_line, tls_line, named, plain_status, tls_status in TARGETS:
            line = plain_line if mode == "plain" else tls_line
            payload = f"{line} HTTP/1.1\r\nHost: {named or host}\r\n\r\n"
            if line == "PRI *":
                payload = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
            out.append((name, mode, payload, [plain_status if mode == "plain" else tls_status]))
    return out


def test_nothing_but_the_allowed_gets_arrive_byte_for_byte_as_logged(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    cases = _payloads()
    toml = """
[egress]
trust_ca_files = ["outside-ca.pem"]
allow = [{ host = "outside.test", port = 8082 }, { host = "outside.test", port = 8445, tls = true }]
"""
    wf = make_workflow(
        command=["python3", "/workflow/code/step.py"],
        extra_toml=toml,
        db_sql=None,
    )
    (wf / "outside-ca.pem").write_text(outside.ca_pem)
    (wf / "code" / "step.py").write_text(textwrap.dedent(STEP))
    (wf / "code" / "cases.json").write_text(json.dumps([c[:3] for c in cases]))
    before = tree_digest(wf)
    record = TestRun(wf, "step1", RunOptions(upstream_networks=(outside.network,))).execute()
    assert tree_digest(wf) == before
    assert record.status is RunStatus.PASSED, record.stderr.text + record.guard_log.text
    run_root = Path(record.workflow_dir) / "runs" / record.id
    results = json.loads((run_root / "g" / "out.json").read_text())
    got = {(name, mode): status for name, mode, status, _ in results}
    expected = {(name, mode): status for name, mode, _, status in cases}
    assert got == expected, [r for r in results if got[(r[0], r[1])] != expected[(r[0], r[1])]]
    for name, _, _, tail in results:
        if "TEST MODE" in tail and "refused" in tail:
            assert "Continue as if it succeeded" not in tail, name  # errors read as errors

    # One line a request (call or start); every start has its outcome.
    lines = call_lines(run_root / "test_mode_actions.jsonl")
    egress = [ln for ln in lines if ln.tool == "http"]
    # One line per request the step sent (a pipelined pair is two), nothing silent.
    assert len(egress) == sum(len(status) for *_, status in cases)
    allowed = [ln for ln in egress if ln.decision == "allow"]
    # Allowed: in each mode the pipelined GET and the plain allowed GET.
    assert len(allowed) == 4
    assert all(ln.detail["host"] == "outside.test" for ln in allowed)
    assert all(ln.detail["status"] == 200 for ln in allowed)  # from each one's outcome line
    assert {ln.detail.get("tls", "") for ln in allowed} == {"", "inspected"}
    for ln in egress:
        assert "http://" not in ln.arguments.get("url", "")[8:], ln.arguments  # never glued

    # What arrived: exactly the allowed GETs, each as logged (hash and text). A kept-alive
    # upstream connection carries several, one after another: each connection's bytes
    # are whole heads, back to back, and nothing else.
    def heads() -> list[bytes]:
        out = []
        for received in outside.raw():
            assert received.endswith(b"\r\n\r\n"), received[-200:]
            out += [head + b"\r\n\r\n" for head in received.split(b"\r\n\r\n")[:-1]]
        return out

    def all_arrived() -> list[bytes]:
        got = heads()
        return got if len(got) >= len(allowed) else []

    arrived = wait_for(all_arrived, 30, "the allowed requests to reach the raw server")
    assert sorted(hashlib.sha256(r).hexdigest() for r in arrived) == sorted(
        ln.detail["forwarded_sha256"] for ln in allowed
    )
    logged = {ln.detail["forwarded_sha256"]: ln.arguments["forwarded_head"] for ln in allowed}
    for received in arrived:
        text = received.decode("latin-1")
        assert text.split("\r\n")[:-2] == logged[hashlib.sha256(received).hexdigest()]
        assert text.startswith("GET /ok-") and "smuggled" not in text
    assert not [s for s in outside.seen() if s["proto"] in ("http", "sloppy")]
