"""The guard's start-up order (`sandbox.guard.startup`): its DNS server answers the
preflight's probe with its proof while its web stack (Starlette, uvicorn, the MCP
SDK) is not imported yet, and the bridge port serves once that stack is in. A real
guard process on the host's loopback, on ports of its own; its import of the web
module is held until the test lets it go, so the order is seen, not timed."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from dnslib import DNSRecord

from sandbox.contracts.guardconfig import READY_MARK
from sandbox.contracts.guardprocess import CONFIG_FILE_ENV
from sandbox.guard.egress.dns import PREFLIGHT_ZONE, preflight_proof
from tests import paths
from tests.conftest import BRIDGE_TOKEN, guard_config

DEADLINE_S = 20.0
WEB = ("starlette", "uvicorn", "mcp", "sandbox.guard.serve", "sandbox.guard.app")

# The guard's own start (`startup.serve`) on sockets bound here, with a finder that
# reports what is imported when the web module's import begins and holds that import
# until a line comes on stdin.
CHILD = """
import gc, json, socket, sys
from sandbox.guard import startup

WEB = {web!r}

class Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "sandbox.guard.serve":
            loaded = sorted(m for m in sys.modules if m.startswith(WEB))
            print("HELD " + json.dumps([loaded, gc.isenabled()]), flush=True)
            sys.stdin.readline()
        return None

def listening(kind):
    sock = socket.socket(socket.AF_INET, kind)
    sock.bind(("127.0.0.1", 0))
    if kind == socket.SOCK_STREAM:
        sock.listen(64)
    return sock

bridge, egress, transparent, dns_tcp = (listening(socket.SOCK_STREAM) for _ in range(4))
dns_udp = listening(socket.SOCK_DGRAM)
print("PORTS " + json.dumps([bridge.getsockname()[1], dns_udp.getsockname()[1]]), flush=True)
sys.meta_path.insert(0, Hold())
raw = open(sys.argv[1], "rb").read()
gc.disable()  # as the guard's entry leaves it (`sandbox.guard.__main__`)
sys.exit(startup.serve(raw, bridge=bridge, egress=egress, direct=(transparent, dns_udp, dns_tcp)))
"""


def _line(proc: subprocess.Popen[bytes], prefix: str, deadline: float) -> str:
    assert proc.stdout is not None
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no {prefix!r} line from the guard"
        if select.select([proc.stdout], [], [], left)[0]:
            line = proc.stdout.readline().decode()
            assert line, f"the guard ended: {proc.wait()} {proc.stderr.read()!r}"  # type: ignore[union-attr]
            if line.startswith(prefix):
                return line[len(prefix) :].strip()


def _proof_from(port: int, nonce: str, deadline: float) -> str:
    query = DNSRecord.question(f"{nonce}.{PREFLIGHT_ZONE}", "TXT")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        sock.sendto(query.pack(), ("127.0.0.1", port))
        reply = DNSRecord.parse(sock.recv(4096))
    return b"".join(bytes(s) for rr in reply.rr for s in rr.rdata.data).decode()


@contextlib.contextmanager
def _held_guard(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, int, float]]:
    """The guard started with its web module's import held: the process, its bridge
    and DNS ports, and the test's deadline."""
    actions = tmp_path / "actions.jsonl"
    actions.touch()
    # The child binds its own sockets and hands them over: the config names no port.
    config = guard_config(actions)
    config_file = tmp_path / "config.json"
    config_file.write_text(config.model_dump_json())
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(web=WEB), str(config_file)],
        cwd=paths.REPO,
        env={**os.environ, "PYTHONPATH": str(paths.REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + DEADLINE_S
        bridge_port, dns_port = json.loads(_line(proc, "PORTS ", deadline))
        web, collecting = json.loads(_line(proc, "HELD ", deadline))
        assert web == []  # nothing of the web stack yet
        # The collector, off through the start-up, is on again once the network side serves.
        assert collecting is True
        yield proc, bridge_port, dns_port, deadline
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _release(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()


def test_the_guard_answers_the_preflights_dns_before_its_web_stack_is_imported(
    tmp_path: Path,
) -> None:
    with _held_guard(tmp_path) as (proc, bridge_port, dns_port, deadline):
        # The web module's import is held: the DNS server answers with the run's proof.
        assert _proof_from(dns_port, "a1b2c3", deadline) == preflight_proof(BRIDGE_TOKEN, "a1b2c3")
        _release(proc)
        assert _line(proc, READY_MARK, deadline) == ""
        with socket.create_connection(("127.0.0.1", bridge_port), timeout=DEADLINE_S) as sock:
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 ")


def test_a_guard_stopped_before_its_web_stack_serves_exits_cleanly(tmp_path: Path) -> None:
    """SIGTERM while the web stack is still being imported (here: its import held): the
    network side and the log close and the guard exits 0 without waiting for that import
    (left to its default action the signal would kill it, and a guard that is PID 1
    would ignore it)."""
    with _held_guard(tmp_path) as (proc, _, dns_port, deadline):
        assert _proof_from(dns_port, "d4e5", deadline) == preflight_proof(BRIDGE_TOKEN, "d4e5")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE_S) == 0  # the import is still held
        assert proc.stdout is not None
        assert READY_MARK.encode() not in proc.stdout.read()


# What the guard needs only once its bridge serves: its ways out (the executor's and the
# upstream's clients, with httptools), imported in the web stack's thread.
WAYS_OUT = (
    "sandbox.guard.bridge.executor",
    "sandbox.guard.bridge.forward",
    "sandbox.guard.bridge.recorded",
    "sandbox.guard.bridge.client",
    "httptools",
)


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`code` in a new interpreter on this tree, its output as text."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=paths.REPO,
        env={**os.environ, "PYTHONPATH": str(paths.REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=DEADLINE_S * 6,
    )


def test_the_guards_start_up_leaves_the_bridges_ways_out_to_the_web_stacks_thread() -> None:
    code = (
        "import json, sys\n"
        "import sandbox.guard.startup as startup\n"
        "print(json.dumps([sorted(sys.modules), list(getattr(startup, 'LATER_MODULES', []))]))\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    loaded, later = json.loads(done.stdout)
    assert "sandbox.guard.egress.transparent" in loaded  # the check sees real imports
    assert [name for name in WAYS_OUT if name in loaded] == []
    # The thread brings them in before the web module, whose app makes them.
    assert later[-1] == "sandbox.guard.serve"
    assert {"sandbox.guard.bridge.executor", "sandbox.guard.bridge.recorded"} <= set(later)


def test_the_guards_entry_loads_its_modules_with_the_collector_off(tmp_path: Path) -> None:
    """`python -m sandbox.guard`'s start-up: no cyclic collection while its modules load
    (`sandbox.guard.startup` turns it on once the network side serves: the held guard
    above). Seen from the entry's own `_load`, which the child replaces; it ends there,
    before anything is bound."""
    config_file = tmp_path / "config.json"
    config_file.write_text("{}")
    code = (
        "import gc, os, sys\n"
        "import sandbox.guard.__main__ as entry\n"
        "def _load():\n"
        "    print('GC', gc.isenabled(), flush=True)\n"
        "    os._exit(0)\n"
        "entry._load = _load\n"
        "sys.exit(entry.main())\n"
    )
    done = _python(code, {CONFIG_FILE_ENV: str(config_file)})
    assert done.stdout.strip() == "GC False", done.stderr
