"""The per-uid rules of a Pod with stdio MCP servers, in a real network namespace.

Needs root (`unshare -n`): the init container's own script installs the rules in a
fresh namespace and checks its read-back, then processes of each uid (the guard's,
the step's, two servers') listen and connect on loopback as they would in the Pod.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sandbox.launch import firewall

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(120)]

GUARD, STEP, SERVER0, SERVER1, SEALED = 10002, 10001, 10100, 10101, 10102
PEERS = firewall.PodPeers(
    step_uid=STEP,
    guard_ports=(8790, 8792),
    servers=((SERVER0, 3128), (SERVER1, 3129), (SEALED, None)),
)

PROBE = textwrap.dedent(
    """
    import encodings.idna, json, os, signal, socket, subprocess, sys
    script, pairs = sys.argv[1], json.loads(sys.argv[2])
    done = subprocess.run(["sh", "-c", "ip link set lo up\\n" + script], capture_output=True, text=True)
    if done.returncode != 0:
        print(json.dumps({"install": done.stdout + done.stderr})); sys.exit(0)
    children = []
    def listen(uid, port):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.setgid(uid); os.setuid(uid)
            server = socket.create_server(("127.0.0.1", port)); os.write(w, b"x")
            while True:
                conn, _ = server.accept(); conn.sendall(b"hi"); conn.close()
        children.append(pid); os.read(r, 1)
    def connect(uid, port):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.setgid(uid); os.setuid(uid)
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
                    out = "answered" if s.recv(2) == b"hi" else "silent"
            except OSError as exc:
                out = type(exc).__name__
            os.write(w, out.encode()); os._exit(0)
        os.waitpid(pid, 0); return os.read(r, 100).decode()
    try:
        for uid, port in [(10002, 8790), (10100, 3128), (10101, 3129), (10001, 9999), (10102, 7000)]:
            listen(uid, port)
        print(json.dumps({f"{u}->{p}": connect(u, p) for u, p in pairs}))
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace of its own needs root")
def test_each_uid_opens_only_what_its_rules_allow() -> None:
    pairs = [
        (STEP, 8790),  # the guard's bridge port
        (STEP, 3128),  # a server's relay port
        (STEP, 7000),  # whatever a server listens on
        (SERVER0, 3128),  # its own relay
        (SERVER0, 3129),  # the other server's relay
        (SERVER0, 8790),  # the guard's ports
        (SERVER0, 9999),  # the step
        (SEALED, 3128),  # no egress list: nothing at all
        (GUARD, 9999),  # the guard reaches the step's executor
    ]
    script = firewall.init_container_script(peers=PEERS)
    done = subprocess.run(
        ["unshare", "-n", "--fork", sys.executable, "-c", PROBE, script, json.dumps(pairs)],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    refused = "ConnectionRefusedError"  # at once: a reset, never a hang
    assert got == {
        f"{STEP}->8790": "answered",
        f"{STEP}->3128": refused,
        f"{STEP}->7000": refused,
        f"{SERVER0}->3128": "answered",
        f"{SERVER0}->3129": refused,
        f"{SERVER0}->8790": refused,
        f"{SERVER0}->9999": refused,
        f"{SEALED}->3128": refused,
        f"{GUARD}->9999": "answered",
    }, got
