"""Escape battery, run 2 of 3: the network and the bridge.

A fake "outside" server (a TCP+UDP listener in its own container on its own
internal Docker network, recording everything it receives) is started by the
test; the run's guard joins that network (`RunOptions(upstream_networks=...)`),
so the step's network namespace has a real route to it. The step must still
not reach it: its TCP is taken by the guard, refused, recorded and closed at
once; UDP never arrives; every DNS query (the engine's resolver's address
included) is answered by the guard's own DNS and recorded. Then the step abuses the bridge: oversized, malformed and
unauthenticated requests, path traversal through local tools, links it
planted, a DB copy swapped for a link to the real DB, log injection and
forged identity fields. Every bridge request must leave exactly one
guard-written line in the action log.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from collections.abc import Iterator

import docker.errors
import pytest
from docker import DockerClient
from docker.models.containers import Container

from sandbox.contracts import names
from sandbox.contracts.wire import ActionLine
from sandbox.guard.egress.transparent import FIRST_READ_S
from sandbox.run.testrun import RunOptions
from tests.polling import wait_for
from tests.security.conftest import (
    Battery,
    assert_attempts_match,
    assert_passed_without_trace,
    attempt_params,
    build_workflow,
    check,
    run_battery,
)

pytestmark = pytest.mark.engine

PORT = 9000

LISTENER = r"""
import socket, threading
def out(text):
    print(text, flush=True)
tcp = socket.socket()
tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
tcp.bind(("0.0.0.0", PORT))
tcp.listen(16)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("0.0.0.0", PORT))
def serve_tcp():
    while True:
        conn, peer = tcp.accept()
        conn.settimeout(2)
        try:
            data = conn.recv(200)
        except OSError:
            data = b""
        out("TCP %s %r" % (peer[0], data))
        conn.close()
threading.Thread(target=serve_tcp, daemon=True).start()
out("READY")
while True:
    data, peer = udp.recvfrom(4096)
    out("UDP %s %r" % (peer[0], data))
""".replace("PORT", str(PORT))

CONTROL = r"""
import socket, sys
ip = sys.argv[1]
socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"control", (ip, PORT))
with socket.create_connection((ip, PORT), timeout=5) as conn:
    conn.sendall(b"control")
""".replace("PORT", str(PORT))

STEP = r"""
import http.client, ipaddress, socket, struct, subprocess, time
import agentworks_bridge

SERVER_IP = "@@SERVER_IP@@"
SERVER_NAME = "@@SERVER_NAME@@"
SUBNET = ipaddress.ip_network("@@SUBNET@@")
PORT = @@PORT@@
BRIDGE_PORT = int(os.environ["AGENTWORKS_BRIDGE_URL"].rsplit(":", 1)[1])
EXEC_PORT = 8799
TOKEN = os.environ["AGENTWORKS_BRIDGE_TOKEN"]
bridge_requests = 0

# --- the route exists: the namespace has an address on the server's network ------------


def on_the_network():
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    mine = [ipaddress.ip_interface(w.split()[3]).ip for w in out.splitlines() if len(w.split()) > 3]
    ours = [str(a) for a in mine if a in SUBNET]
    return ("yes", ours) if ours else ("NO", out)


attempt("the namespace has an interface on the outside network", on_the_network)

# --- direct traffic to the outside server ------------------------------------------


GUARD_RANGE = ipaddress.ip_network("198.18.0.0/15")  # the guard's DNS hands these out


def tcp_direct():
    # The firewall hands every TCP connection to the guard: bytes that are neither
    # HTTP nor TLS must be refused and the connection closed at once, never answered.
    start = time.monotonic()
    try:
        with socket.create_connection((SERVER_IP, PORT), timeout=5) as conn:
            conn.sendall(b"STEP-ESCAPE tcp")
            reply = conn.recv(100)
    except ConnectionResetError:
        reply = b""
    except OSError as exc:
        return errname(exc), "", {"seconds": round(time.monotonic() - start, 3)}
    seconds = round(time.monotonic() - start, 3)
    if reply:
        return "ANSWERED", repr(reply[:60]), {"seconds": seconds}
    return "closed by the guard", "", {"seconds": seconds}


def udp_direct():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    results = []
    for _ in range(3):
        try:
            sock.sendto(b"STEP-ESCAPE udp", (SERVER_IP, PORT))
            results.append("sent")
        except OSError as exc:
            results.append(errname(exc))
    return results[0], "", {"all": results}


def udp_connected():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(1)
    sock.connect((SERVER_IP, PORT))
    results = []
    for _ in range(2):
        try:
            sock.send(b"STEP-ESCAPE udp-connected")
            results.append("sent")
        except OSError as exc:
            results.append(errname(exc))
    try:
        sock.recv(100)
        results.append("ANSWER")
    except OSError as exc:
        results.append(errname(exc))
    return results[0], "", {"all": results}


def by_the_guard(addresses):
    # The outcome of a lookup: only addresses of the guard's own range are safe.
    if addresses and all(ipaddress.ip_address(a) in GUARD_RANGE for a in addresses):
        return "answered by the guard", "", {"addresses": addresses}
    return "RESOLVED", str(addresses)[:90]


def resolve_server_name():
    infos = socket.getaddrinfo(SERVER_NAME, PORT, socket.AF_INET, proto=socket.IPPROTO_TCP)
    return by_the_guard(sorted({i[4][0] for i in infos}))


def dns_query():
    qname = b"".join(bytes([len(p)]) + p.encode() for p in SERVER_NAME.split(".")) + b"\0"
    return struct.pack(">HHHHHH", 0x5BD, 0x100, 1, 0, 0, 0) + qname + struct.pack(">HH", 1, 1)


def answer_addresses(reply):
    # The A records of a reply to dns_query(): one question, so one answer ends it.
    count = struct.unpack(">H", reply[6:8])[0]
    if reply[3] & 0xF or not count:
        return []
    return [socket.inet_ntoa(reply[-4:])] if count == 1 else ["%d answers" % count]


def dns_query_engine_resolver():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(5)
    sock.sendto(dns_query(), ("127.0.0.11", 53))
    return by_the_guard(answer_addresses(sock.recvfrom(512)[0]))


def dns_over_tcp_engine_resolver():
    query = dns_query()
    with socket.create_connection(("127.0.0.11", 53), timeout=5) as conn:
        conn.sendall(struct.pack(">H", len(query)) + query)
        reply = conn.recv(4096)[2:]
    return by_the_guard(answer_addresses(reply))


attempt("TCP connect to the outside server", tcp_direct)
attempt("UDP sendto the outside server", udp_direct)
attempt("UDP connect+send to the outside server", udp_connected)
attempt("resolve the server's container name", resolve_server_name)
attempt("raw DNS query to the engine resolver 127.0.0.11:53", dns_query_engine_resolver)
attempt("TCP connect to 127.0.0.11:53", dns_over_tcp_engine_resolver)

# --- sockets that bypass IP filtering ---------------------------------------------------
attempt("ICMP datagram socket (ping)", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP))
attempt("ICMPv6 datagram socket", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_ICMPV6))
attempt("raw socket AF_INET/SOCK_RAW", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP))
attempt("raw socket AF_INET6/SOCK_RAW", lambda: socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_UDP))
attempt("packet socket AF_PACKET", lambda: socket.socket(17, socket.SOCK_RAW, 0x0300))
attempt("AF_VSOCK socket", lambda: socket.socket(40, socket.SOCK_STREAM, 0))
attempt("AF_VSOCK with bit 32 set (raw syscall)", lambda: sys_call(41, 0x100000028, 1, 0))

# --- the firewall itself ----------------------------------------------------------------


def flush_rules():
    runs = [subprocess.run([tool, "-w", "-F", "OUTPUT"], capture_output=True, text=True, timeout=10) for tool in ("iptables", "ip6tables")]
    if all(r.returncode != 0 for r in runs):
        return "failed", runs[0].stderr.strip()[-90:], {"rc": [r.returncode for r in runs]}
    return "FLUSHED", "", {"rc": [r.returncode for r in runs]}


def change_links_and_routes():
    runs = [
        subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        for cmd in (["ip", "link", "set", "lo", "down"], ["ip", "route", "add", "10.99.0.0/24", "dev", "lo"], ["ip", "addr", "add", "10.98.0.1/32", "dev", "lo"])
    ]
    if all(r.returncode != 0 for r in runs):
        return "failed", runs[0].stderr.strip()[-90:]
    return "CHANGED", [r.returncode for r in runs]


attempt("iptables/ip6tables -F OUTPUT as the step", flush_rules)
attempt("TCP to the outside server after the flush attempt", tcp_direct)
attempt("ip link/route/addr changes", change_links_and_routes)


def hijack_bridge_port(reuse_port):
    def go():
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", BRIDGE_PORT))
        sock.listen(1)
        return "BOUND"
    return go


attempt("bind the bridge port 127.0.0.1:8790", hijack_bridge_port(False))
attempt("bind the bridge port with SO_REUSEPORT", hijack_bridge_port(True))

# --- raw HTTP abuse of the bridge and the executor ------------------------------------------


def http_post(port, path, body, token):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    if token is not None:
        headers["Authorization"] = "Bearer " + token
    sent = "sent"
    try:
        try:
            conn.request("POST", path, body=body, headers=headers)
        except OSError as exc:  # the server may answer and close before the body is in
            sent = errname(exc)
        response = conn.getresponse()
        payload = response.read()[:120].decode(errors="replace")
        return "HTTP %d" % response.status, payload, {"send": sent}
    finally:
        conn.close()


def bridge_post(body, token=TOKEN):
    def go():
        global bridge_requests
        bridge_requests += 1
        return http_post(BRIDGE_PORT, "/v1/tools/call", body, token)
    return go


HUGE = json.dumps({"tool": "notify_user", "arguments": {"text": "A" * (5 << 20)}}).encode()
attempt("bridge: 5 MiB request", bridge_post(HUGE))
attempt("bridge: malformed JSON", bridge_post(b'{"tool": "notify_user", "arguments": '))
attempt("bridge: not JSON at all", bridge_post(b"\xff\xfe\x00garbage"))
attempt("bridge: wrong token", bridge_post(b'{"tool": "notify_user", "arguments": {}}', "not-the-token-" + TOKEN[:4]))
attempt("bridge: no token", bridge_post(b'{"tool": "notify_user", "arguments": {}}', None))

EXEC_BODY = json.dumps({"tool": "list_dir", "arguments": {"path": "."}}).encode()
attempt("executor: call without its token", lambda: http_post(EXEC_PORT, "/v1/exec", EXEC_BODY, None))
attempt("executor: call with the bridge token", lambda: http_post(EXEC_PORT, "/v1/exec", EXEC_BODY, TOKEN))


def stolen_exec_token():
    stolen = None
    for path in ["/proc/1/environ", "/proc/self/environ"]:
        try:
            entries = open(path, "rb").read().split(b"\0")
        except OSError:
            continue
        for entry in entries:
            if entry.startswith(b"AGENTWORKS_EXEC_TOKEN="):
                stolen = entry.split(b"=", 1)[1].decode()
    if not stolen:
        return "no token to steal"
    status, payload, _ = http_post(EXEC_PORT, "/v1/exec", EXEC_BODY, stolen)
    return status, "unlogged executor call with a stolen token: " + payload[:60]


attempt("executor: call with a token stolen from /proc/1/environ", stolen_exec_token)

# --- path traversal through the bridge's local tools ----------------------------------------
os.makedirs(".git", exist_ok=True)
with open(".git/config", "w") as handle:
    handle.write("[core]\n# GIT-SECRET-7f3\n")
os.symlink("/etc/passwd", "leak")
os.symlink("/workflow", "wfdir")
os.symlink("/test/db/db.sqlite", "dblink")
MARKERS = ("root:x:", "SQLite format", "GIT-SECRET-7f3", "step1", "workflow.toml", "ESCAPED")


def bridge_call(tool, args):
    global bridge_requests
    bridge_requests += 1
    return agentworks_bridge.call(tool, args, timeout_s=60)


def tool_refused(tool, args):
    def go():
        reply = bridge_call(tool, args)
        result = reply.get("result") or {}
        text = str(result.get("text", ""))
        if any(m in text for m in MARKERS):
            return "LEAKED", text[:100]
        if reply.get("ok") is False and result.get("is_error") and "refused" in text.lower():
            return "refused", text[:100]
        return "NOT REFUSED", text[:100]
    return go


for name, tool, args in [
    ("read_file ../../workflow/db/db.sqlite", "read_file", {"path": "../../workflow/db/db.sqlite"}),
    ("read_file /etc/passwd", "read_file", {"path": "/etc/passwd"}),
    ("read_file ~/.bashrc", "read_file", {"path": "~/.bashrc"}),
    ("read_file .git/config", "read_file", {"path": ".git/config"}),
    ("read_file planted symlink -> /etc/passwd", "read_file", {"path": "leak"}),
    ("read_file through planted dir link -> /workflow", "read_file", {"path": "wfdir/workflow.toml"}),
    ("read_file with a NUL byte", "read_file", {"path": "ok.txt\x00/../../etc/passwd"}),
    ("list_dir through planted dir link", "list_dir", {"path": "wfdir"}),
    ("list_dir /", "list_dir", {"path": "/"}),
    ("search_files under /etc", "search_files", {"pattern": "root", "path": "/etc"}),
    ("write_file through planted link -> DB copy", "write_file", {"path": "dblink", "content": "ESCAPED"}),
    ("write_file through planted dir link -> /workflow", "write_file", {"path": "wfdir/evil.txt", "content": "ESCAPED"}),
]:
    attempt(name, tool_refused(tool, args))


def db_copy_swapped_for_real_db():
    os.rename("/test/db/db.sqlite", "/test/db/moved.sqlite")
    os.symlink("/workflow/db/db.sqlite", "/test/db/db.sqlite")
    try:
        reply = bridge_call("mutate_workflow_db", {"sql": "INSERT INTO t VALUES (666, 'ESCAPED')"})
    finally:
        os.unlink("/test/db/db.sqlite")
        os.rename("/test/db/moved.sqlite", "/test/db/db.sqlite")
    result = reply.get("result") or {}
    if result.get("is_error"):
        return "tool error", str(result.get("text", ""))[:100]
    return "WROTE", str(result.get("text", ""))[:100]


attempt("mutate_workflow_db after swapping the DB copy for a link to the real DB", db_copy_swapped_for_real_db)

INJECTION = 'x"}\n{"time": "2020-01-01T00:00:00Z", "session": "root", "tool": "FORGED", "decision": "allow", "reason": "forged"}\n'


def decision_of(tool, args):
    def go():
        reply = bridge_call(tool, args)
        return str(reply.get("decision")), str(reply.get("reason", ""))[:80]
    return go


attempt("log injection through a tool argument", decision_of("notify_user", {"text": INJECTION}))
attempt("forged identity fields", decision_of("notify_user", {"text": "identity", "run_id": "FORGED-RUN", "workflow": "FORGED-WF", "session_id": "FORGED-S"}))
attempt("a forged value at a bound path", decision_of("agent_browser", {"command": "click #x", "session": "FORGED-BOUND"}))
attempt("recursive execute_step from inside the run", decision_of("execute_step", {"step_id": "step1"}))
attempt("the guard still answers", decision_of("notify_user", {"text": "still here"}))
report("bridge requests made", "counted", "", {"count": bridge_requests})
"""

REFUSED = {"refused"}

SAFE: dict[str, set[str]] = {
    "the namespace has an interface on the outside network": {"yes"},
    # The guard takes it, refuses it and closes it; that it does so AT ONCE, and
    # records it, is asserted separately (see below).
    "TCP connect to the outside server": {"closed by the guard"},
    # REJECT in OUTPUT: the local send fails (EPERM) or the ICMP error comes back;
    # the server's own log (asserted separately) is what proves nothing arrived.
    "UDP sendto the outside server": {"EPERM", "ECONNREFUSED", "sent"},
    "UDP connect+send to the outside server": {"EPERM", "ECONNREFUSED", "sent"},
    # Every query lands on the guard's DNS, which answers with its own addresses; the
    # engine's resolver never sees one (its answer would be the server's real address).
    "resolve the server's container name": {"answered by the guard"},
    "raw DNS query to the engine resolver 127.0.0.11:53": {"answered by the guard"},
    "TCP connect to 127.0.0.11:53": {"answered by the guard"},
    "ICMP datagram socket (ping)": {"EACCES"},
    "ICMPv6 datagram socket": {"EACCES"},
    "raw socket AF_INET/SOCK_RAW": {"EPERM"},
    "raw socket AF_INET6/SOCK_RAW": {"EPERM"},
    "packet socket AF_PACKET": {"EPERM"},
    "AF_VSOCK socket": {"EPERM"},
    "AF_VSOCK with bit 32 set (raw syscall)": {"EPERM"},
    "iptables/ip6tables -F OUTPUT as the step": {"failed"},
    "TCP to the outside server after the flush attempt": {"closed by the guard"},
    "ip link/route/addr changes": {"failed"},
    "bind the bridge port 127.0.0.1:8790": {"EADDRINUSE"},
    "bind the bridge port with SO_REUSEPORT": {"EADDRINUSE"},
    "bridge: 5 MiB request": {"HTTP 413"},
    "bridge: malformed JSON": {"HTTP 400"},
    "bridge: not JSON at all": {"HTTP 400"},
    "bridge: wrong token": {"HTTP 401"},
    "bridge: no token": {"HTTP 401"},
    "executor: call without its token": {"HTTP 401"},
    "executor: call with the bridge token": {"HTTP 401"},
    "executor: call with a token stolen from /proc/1/environ": {"no token to steal", "HTTP 401"},
    "read_file ../../workflow/db/db.sqlite": REFUSED,
    "read_file /etc/passwd": REFUSED,
    "read_file ~/.bashrc": REFUSED,
    "read_file .git/config": REFUSED,
    "read_file planted symlink -> /etc/passwd": REFUSED,
    "read_file through planted dir link -> /workflow": REFUSED,
    "read_file with a NUL byte": REFUSED,
    "list_dir through planted dir link": REFUSED,
    "list_dir /": REFUSED,
    "search_files under /etc": REFUSED,
    "write_file through planted link -> DB copy": REFUSED,
    "write_file through planted dir link -> /workflow": REFUSED,
    "mutate_workflow_db after swapping the DB copy for a link to the real DB": {"tool error"},
    "log injection through a tool argument": {"stub"},
    "forged identity fields": {"stub"},
    "a forged value at a bound path": {"stub"},
    "recursive execute_step from inside the run": {"refuse"},
    "the guard still answers": {"stub"},
    "bridge requests made": {"counted"},
}

KNOWN_HOLES: dict[str, str] = {}


def _server_log(server: Container) -> list[str]:
    return server.logs(stdout=True, stderr=True).decode(errors="replace").splitlines()


@pytest.fixture(scope="module")
def battery(engine: DockerClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Battery]:
    tag = secrets.token_hex(4)
    net_name, server_name = f"sbx-sec-{tag}", f"sbx-sec-srv-{tag}"
    net = engine.networks.create(net_name, internal=True, labels={"sandbox.fake": "1"})
    server: Container | None = None
    try:
        server = engine.containers.run(
            names.STEP_IMAGE,
            ["python3", "-u", "-c", LISTENER],
            name=server_name,
            user="10001:10001",
            network=net_name,
            labels={"sandbox.fake": "1"},
            read_only=True,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges:true"],
            mem_limit=64 * 1024**2,
            pids_limit=32,
            detach=True,
        )
        # Deadlines are generous: a loaded shared host starts containers slowly.
        wait_for(lambda: "READY" in _server_log(server), 120, "the fake outside server")
        server.reload()
        server_ip = server.attrs["NetworkSettings"]["Networks"][net_name]["IPAddress"]
        net.reload()
        subnet = net.attrs["IPAM"]["Config"][0]["Subnet"]
        # Positive control: the listener records what does reach it.
        code, output = server.exec_run(["python3", "-c", CONTROL, server_ip], user="10001")
        assert code == 0, output
        wait_for(
            lambda: (
                {ln.split()[0] for ln in _server_log(server) if "b'control'" in ln}
                == {"TCP", "UDP"}
            ),
            120,
            "the control packets (one UDP, one TCP) in the server's log",
        )
        root = tmp_path_factory.mktemp("sec-net")
        script = (
            STEP.replace("@@SERVER_IP@@", server_ip)
            .replace("@@SERVER_NAME@@", server_name)
            .replace("@@SUBNET@@", subnet)
            .replace("@@PORT@@", str(PORT))
        )
        wf = build_workflow(root, script, earlier_files={"in.txt": "in"})
        result = run_battery(engine, wf, RunOptions(upstream_networks=(net_name,)))
        result.extra["server_log"] = _server_log(server)
        result.extra["server_ip"], result.extra["server_name"] = server_ip, server_name
        yield result
    finally:
        if server is not None:
            with contextlib.suppress(docker.errors.NotFound):
                server.remove(force=True)
        net.remove()


def test_run_finished_and_left_no_trace(battery: Battery) -> None:
    assert_passed_without_trace(battery)


def test_every_reported_attempt_is_asserted(battery: Battery) -> None:
    assert_attempts_match(battery, SAFE)


@pytest.mark.parametrize("name", attempt_params(SAFE, KNOWN_HOLES))
def test_attempt_is_contained(battery: Battery, name: str) -> None:
    check(battery, name, SAFE[name])


def test_direct_tcp_is_closed_at_once_and_recorded(battery: Battery) -> None:
    for name in (
        "TCP connect to the outside server",
        "TCP to the outside server after the flush attempt",
    ):
        got = battery.outcome(name)
        seconds = (got.data or {}).get("seconds", 99)
        # Closed before the guard's first-read wait could run out: judged, not left to hang.
        assert got.outcome == "closed by the guard" and seconds < FIRST_READ_S, (
            f"{name}: the guard must refuse and close it at once, got {got.outcome} "
            f"after {seconds} s"
        )
    lines = [ActionLine.model_validate_json(line) for line in battery.action_lines()]
    direct = [p for p in lines if p.tool == "http"]
    assert [(p.decision, p.arguments["method"], p.detail["via"]) for p in direct] == [
        ("refuse", "TCP", "direct")
    ] * 2, direct
    server_ip = battery.extra["server_ip"]
    assert {p.detail["destination"] for p in direct} == {f"{server_ip}:{PORT}"}
    assert {p.arguments["first_sha256"] for p in direct} == {
        hashlib.sha256(b"STEP-ESCAPE tcp").hexdigest()
    }


def test_every_lookup_is_on_the_record(battery: Battery) -> None:
    lines = [ActionLine.model_validate_json(line) for line in battery.action_lines()]
    lookups = [p for p in lines if p.tool == "dns"]
    server_name = battery.extra["server_name"]
    # getaddrinfo (A), the raw UDP query, the query over TCP: each one line, each for the
    # name asked and answered with the same address of the guard's own.
    assert [(p.arguments["name"], p.arguments["type"]) for p in lookups] == [
        (server_name, "A")
    ] * 3, lookups
    answers = {p.detail["answer"] for p in lookups}
    resolved = battery.outcome("resolve the server's container name").data["addresses"]
    assert answers == set(resolved) and len(answers) == 1


def test_nothing_reached_the_outside_server(battery: Battery) -> None:
    received = [
        line for line in battery.extra["server_log"] if line != "READY" and "b'control'" not in line
    ]
    assert received == [], f"the outside server received traffic from the step: {received}"


def test_action_log_has_one_guard_line_per_bridge_request(battery: Battery) -> None:
    lines = battery.action_lines()
    count = battery.outcome("bridge requests made").data["count"]
    parsed = [ActionLine.model_validate_json(line) for line in lines]  # every line well-formed
    # One call line per request; a forwarded one's outcome line follows its start. The
    # step's direct TCP, its lookups and its refused datagrams have lines of their own
    # (tools http, dns and packet), not bridge requests.
    calls = [p for p in parsed if p.event != "outcome" and p.tool not in ("http", "dns", "packet")]
    others = [p for p in parsed if p.tool in ("http", "dns")]
    assert len(others) == 5 and all(p.event == "call" for p in others)  # 2 TCP, 3 lookups
    # The UDP sends, refused by the firewall, are on the record (where they were aimed).
    datagrams = [p for p in parsed if p.tool == "packet"]
    server = battery.extra["server_ip"]
    assert datagrams and all(p.decision == "refuse" for p in datagrams)
    assert {(p.arguments["protocol"], p.arguments["destination"]) for p in datagrams} == {
        ("udp", server)
    }
    assert len(calls) == count, f"{count} bridge requests but {len(calls)} calls logged"
    starts = [p.call_id for p in parsed if p.event == "start"]
    assert starts == [p.call_id for p in parsed if p.event == "outcome"]
    assert not any(p.tool == "FORGED" for p in parsed), "a forged line got into the log"
    refused_requests = [p for p in parsed if p.category == "request"]
    assert sorted(p.reason.split()[0] for p in refused_requests) == [
        "malformed",
        "malformed",
        "request",
        "wrong",
        "wrong",
    ], [p.reason for p in refused_requests]
    assert all(p.decision == "refuse" for p in refused_requests)
    forged = [
        p for p in parsed if p.tool == "notify_user" and p.arguments.get("text") == "identity"
    ]
    assert len(forged) == 1
    # The line's own identity is the guard's. notify_user binds no argument, so keys
    # that merely look like identity are the step's own arguments, recorded as sent.
    assert forged[0].session == "root" and forged[0].tool == "notify_user"
    assert forged[0].arguments["run_id"] == "FORGED-RUN"
    # A forged value at a bound path (agent_browser's session) is never recorded.
    assert "FORGED-BOUND" not in "\n".join(lines)
    # No line carries the content of a file the step was not allowed to read.
    for marker in ("root:x:", "GIT-SECRET-7f3", "SQLite format"):
        assert marker not in "\n".join(lines)
