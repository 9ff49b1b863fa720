"""The guard as its container runs it (the entry point of `python -m sandbox.guard`), as
a process on the host's loopback: its event loop and HTTP parser, the head cap that
parser lacks, the firewall's gate, the ready line and the exit on SIGTERM. No engine:
the process and its sockets are real, on ports the kernel gives (see ENTRY), the config
file is the runner's shape."""

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
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandbox.contracts.guardconfig import CONFIG_FILE_ENV, READY_MARK, GuardConfig
from sandbox.contracts.guardprocess import (
    DNS_PORT,
    FIREWALL_GATE_FD_ENV,
    FIREWALL_GATE_OK,
    TRANSPARENT_PORT,
)
from sandbox.contracts.wire import ActionLine
from sandbox.guard.limits import MAX_HEADER_BYTES, TRANSPORT_MAX_HEAD_BYTES
from sandbox.guard.serve import HEAD_TOO_LARGE
from tests import paths
from tests.conftest import BRIDGE_TOKEN as TOKEN
from tests.conftest import guard_config
from tests.polling import wait_for

REPO = paths.REPO
DEADLINE_S = 20.0
# The ports the config asks for: never bound on the host (see ENTRY); not the
# contract's defaults, so the guard is seen to take them from its config.
BRIDGE_ASKED, EGRESS_ASKED = 18790, 18792

# The guard's entry point (`python -m sandbox.guard`: its `main`, gate and all) with
# every loopback port it binds given by the kernel, and each bind reported on stdout
# (`BOUND [kind, port asked, port got]`). In a run the guard has a network namespace
# of its own; here it shares the host's loopback with every other test session, where
# its fixed ports (and any port picked free beforehand) may be taken.
ENTRY = """
import json, sys
import sandbox.guard.__main__ as entry

def kernel_given(kind, bind):
    def bind_any(port):
        sock = bind(0)
        print("BOUND " + json.dumps([kind, port, sock.getsockname()[1]]), flush=True)
        return sock
    return bind_any

entry.bind_loopback = kernel_given("tcp", entry.bind_loopback)
entry.bind_udp_loopback = kernel_given("udp", entry.bind_udp_loopback)
sys.exit(entry.main())
"""
ASKED = {
    ("tcp", BRIDGE_ASKED),
    ("tcp", EGRESS_ASKED),
    ("tcp", TRANSPARENT_PORT),
    ("tcp", DNS_PORT),
    ("udp", DNS_PORT),
}


def _start(tmp_path: Path, config: GuardConfig, **popen: Any) -> subprocess.Popen[bytes]:
    """The guard's entry point (see ENTRY) with `config` in its file."""
    config_file = tmp_path / "config.json"
    config_file.write_text(config.model_dump_json())
    env = {**os.environ, **popen.pop("env", {}), CONFIG_FILE_ENV: str(config_file)}
    return subprocess.Popen(
        [sys.executable, "-c", ENTRY],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )


def _ready(proc: subprocess.Popen[bytes]) -> dict[tuple[str, int], int]:
    """Wait for the guard's ready line; the ports it bound before it (asked -> got),
    which must be every port the guard listens on, each asked for once."""
    assert proc.stdout is not None
    deadline = time.monotonic() + DEADLINE_S
    out = b""
    while READY_MARK.encode() + b"\n" not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"no ready line; stdout {out!r}"
        if select.select([proc.stdout], [], [], left)[0]:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, f"the guard ended: {proc.wait()} {proc.stderr.read()!r}"  # type: ignore[union-attr]
            out += chunk
    bound = [json.loads(x[len(b"BOUND ") :]) for x in out.splitlines() if x.startswith(b"BOUND ")]
    ports = {(kind, asked): got for kind, asked, got in bound}
    assert len(ports) == len(bound) and set(ports) == ASKED, bound
    return ports


@dataclass
class GuardProcess:
    proc: subprocess.Popen[bytes]
    port: int
    actions: Path

    def lines(self) -> list[ActionLine]:
        return [ActionLine.model_validate_json(x) for x in self.actions.read_text().splitlines()]

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=DEADLINE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


@contextlib.contextmanager
def guard_process(tmp_path: Path) -> Iterator[GuardProcess]:
    """The guard's entry point with a config file, once it printed its ready line
    (durability per-call: the log's writer thread hands back to the loop after a sync)."""
    actions = tmp_path / "actions.jsonl"
    actions.touch()
    config = guard_config(actions, bridge_port=BRIDGE_ASKED, egress_port=EGRESS_ASKED)
    proc = _start(tmp_path, config.model_copy(update={"durability": "per-call"}))
    try:
        ports = _ready(proc)
        assert not (tmp_path / "config.json").exists()  # read once and removed
        yield GuardProcess(proc, ports[("tcp", BRIDGE_ASKED)], actions)
    finally:
        _stop(proc)


def _request(head_lines: list[bytes], body: bytes = b"") -> bytes:
    lines = [*head_lines, b"Content-Length: %d" % len(body)]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _call(tool: str, extra: list[bytes] | None = None, session: str | None = None) -> bytes:
    call = {"tool": tool, "arguments": {"text": "hi"}, **({"session": session} if session else {})}
    body = json.dumps(call).encode()
    head = [
        b"POST /v1/tools/call HTTP/1.1",
        b"Host: 127.0.0.1",
        b"Authorization: Bearer " + TOKEN.encode(),
        *(extra or []),
    ]
    return _request(head, body)


_UNREAD: weakref.WeakKeyDictionary[socket.socket, bytes] = weakref.WeakKeyDictionary()


def _read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One reply with a Content-Length body (what the guard sends). Bytes past it (a
    pipelined reply that came in the same segment) are kept for the next call."""
    data = _UNREAD.pop(sock, b"")
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a reply: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *fields = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (f.split(":", 1) for f in fields)}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed inside a reply body"
        rest += chunk
    if rest[length:]:
        _UNREAD[sock] = rest[length:]
    return int(status_line.split()[1]), headers, rest[:length]


def _closed(sock: socket.socket) -> bool:
    """Whether the guard closed the connection (EOF or reset within the deadline)."""
    sock.settimeout(DEADLINE_S)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_guard_serves_on_uvloop_and_httptools_and_logs_before_it_replies(
    tmp_path: Path,
) -> None:
    with guard_process(tmp_path) as guard:
        maps = _maps(guard.proc.pid)
        assert "/uvloop/loop." in maps, "the guard's event loop is not uvloop"
        assert "/httptools/parser/parser." in maps, "the bridge port is not on httptools"
        with guard.connect() as sock:
            for n in range(3):  # one kept-alive connection, a line before each reply
                sock.sendall(_call("notify_user"))
                status, headers, body = _read_reply(sock)
                assert status == 200 and json.loads(body)["decision"] == "stub"
                assert headers.get("connection") != "close"
                assert len(guard.lines()) == n + 1
            # Two requests in one write (a pipeline): both answered in order, both logged.
            sock.sendall(_call("notify_user") + _call("notify_user", session="s-nope"))
            first, second = _read_reply(sock), _read_reply(sock)
            assert first[0] == 200 and json.loads(first[2])["decision"] == "stub"
            assert second[0] == 200 and json.loads(second[2])["decision"] == "refuse"
        assert [x.decision for x in guard.lines()] == ["stub"] * 4 + ["refuse"]


def test_a_head_past_the_transport_cap_is_431_and_the_connection_closed(
    tmp_path: Path,
) -> None:
    """A head under the transport cap but past the header cap reaches the guard's code
    (431 with its line); one past the transport cap is refused by the server itself
    (431, no line), whether it comes in one write, dribbled, or after a kept-alive
    call; a head that never ends is refused long before the guard has read it."""
    with guard_process(tmp_path) as guard:
        pad = b"X-Pad: " + b"a" * (MAX_HEADER_BYTES + 1024)
        with guard.connect() as sock:
            sock.sendall(_call("notify_user", [pad]))
            status, headers, body = _read_reply(sock)
            assert status == 431 and "16 KiB" in json.loads(body)["error"]
        assert [(x.category, x.decision) for x in guard.lines()] == [("request", "refuse")]

        big = b"X-Pad: " + b"a" * (TRANSPORT_MAX_HEAD_BYTES + 1024)
        with guard.connect() as sock:  # in one write
            sock.sendall(_call("notify_user", [big]))
            status, headers, body = _read_reply(sock)
            assert (status, json.loads(body)) == (431, {"error": HEAD_TOO_LARGE})
            assert headers["connection"] == "close" and _closed(sock)

        with guard.connect() as sock:  # after a call on the same connection, dribbled
            sock.sendall(_call("notify_user"))
            assert _read_reply(sock)[0] == 200
            request = _call("notify_user", [big])
            answer: tuple[int, dict[str, str], bytes] | None = None
            for at in range(0, len(request), 1024):
                sock.sendall(request[at : at + 1024])
                if select.select([sock], [], [], 0)[0]:
                    answer = _read_reply(sock)
                    break
            if answer is None:
                answer = _read_reply(sock)
            assert (answer[0], json.loads(answer[2])) == (431, {"error": HEAD_TOO_LARGE})
            assert _closed(sock)

        with guard.connect() as sock:  # a head that never ends: refused, then closed
            sock.sendall(b"POST /v1/tools/call HTTP/1.1\r\nX-Pad: ")
            sent = 0
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                while sent < 256 * 1024 * 1024:  # far more than any socket buffer holds
                    sent += sock.send(b"a" * 65536)
            assert sent < 256 * 1024 * 1024, "the guard kept reading an endless head"
        # The head under the cap, and the kept-alive call; the refused heads have none.
        assert [x.decision for x in guard.lines()] == ["refuse", "stub"]
        assert guard.proc.poll() is None  # the guard lives


def _sockets(pid: int) -> int:
    """The process's open sockets (an fd closed while this counts is not one)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            count += os.readlink(fd).startswith("socket:")
    return count


def test_sigterm_to_an_idle_guard_exits_at_once_with_its_log_whole(tmp_path: Path) -> None:
    with guard_process(tmp_path) as guard:
        listening = _sockets(guard.proc.pid)
        with guard.connect() as sock:
            sock.sendall(_call("notify_user"))
            assert _read_reply(sock)[0] == 200
        # Idle once the guard has closed its side of the connection.
        wait_for(lambda: _sockets(guard.proc.pid) == listening, DEADLINE_S, "the guard idle")
        guard.proc.send_signal(signal.SIGTERM)
        assert guard.proc.wait(timeout=DEADLINE_S) == 0  # the idle exit, not a shutdown
        assert [x.decision for x in guard.lines()] == ["stub"]


def test_sigterm_to_a_busy_guard_shuts_it_down_with_its_log_whole(tmp_path: Path) -> None:
    """A connection still open: uvicorn's own graceful shutdown (which ends the process
    with the signal it caught), the lines of every answered call on disk."""
    with guard_process(tmp_path) as guard, guard.connect() as sock:
        sock.sendall(_call("notify_user"))
        assert _read_reply(sock)[0] == 200
        guard.proc.send_signal(signal.SIGTERM)
        assert guard.proc.wait(timeout=DEADLINE_S) == -signal.SIGTERM
        assert [x.decision for x in guard.lines()] == ["stub"]


@pytest.mark.parametrize("method", [b"GET", b"POST"])
def test_an_upgrade_request_is_served_as_plain_http(tmp_path: Path, method: bytes) -> None:
    """No upgrade is ever made: a request asking for one is an ordinary request."""
    with guard_process(tmp_path) as guard, guard.connect() as sock:
        path = b"/v1/health" if method == b"GET" else b"/v1/tools/call"
        head = [
            method + b" " + path + b" HTTP/1.1",
            b"Host: 127.0.0.1",
            b"Connection: Upgrade",
            b"Upgrade: websocket",
        ]
        sock.sendall(_request(head))
        status, _, body = _read_reply(sock)
        assert status == (200 if method == b"GET" else 401), body


def _reading(pid: int, fd: int) -> bool:
    """The process sits in read(2) on `fd` (x86-64's syscall 0; /proc/PID/syscall)."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return len(fields) > 1 and fields[0] == "0" and int(fields[1], 16) == fd


@contextlib.contextmanager
def _guard_at_its_gate(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """The guard's entry point as a Docker run's guard starts: with the firewall's gate
    (`sandbox.guard.nflogbind`), once it waits there (its modules loaded) with no socket
    and no port bound; the process and the gate's write end (the test's to open or close)."""
    actions = tmp_path / "actions.jsonl"
    actions.touch()
    config = guard_config(actions, bridge_port=BRIDGE_ASKED, egress_port=EGRESS_ASKED)
    read_end, write_end = os.pipe()
    proc = _start(tmp_path, config, env={FIREWALL_GATE_FD_ENV: str(read_end)}, pass_fds=(read_end,))
    os.close(read_end)  # the guard's is the only read end; the test holds the write end
    try:
        wait_for(lambda: _reading(proc.pid, read_end), DEADLINE_S, "the guard at its gate")
        # Nothing bound while the rules may still go in: no socket, no bind reported.
        assert _sockets(proc.pid) == 0
        assert proc.stdout is not None and not select.select([proc.stdout], [], [], 0)[0]
        yield proc, write_end
    finally:
        with contextlib.suppress(OSError):
            os.close(write_end)
        _stop(proc)


def test_the_guard_binds_nothing_until_its_firewall_gate_says_ok(tmp_path: Path) -> None:
    with _guard_at_its_gate(tmp_path) as (proc, gate):
        os.write(gate, FIREWALL_GATE_OK)
        os.close(gate)
        port = _ready(proc)[("tcp", BRIDGE_ASKED)]
        socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S).close()


def test_a_gate_closed_without_ok_ends_the_guard_before_it_listens(tmp_path: Path) -> None:
    """The install script failed (a rule missing, a wrong readback): it ends without
    opening the gate, and the guard exits without ever listening."""
    with _guard_at_its_gate(tmp_path) as (proc, gate):
        os.close(gate)
        assert proc.wait(timeout=DEADLINE_S) == 2
        assert proc.stderr is not None and proc.stdout is not None
        assert b"the firewall did not come up" in proc.stderr.read()
        assert b"BOUND" not in proc.stdout.read()  # not one port bound
