"""The stdio server's relay: the server's stdin and stdout are the guard's socket itself
(no engine; the relay runs as it does in a server's container, as a process)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from sandbox.guard.listeners import bind_unix

# A "server" that says what its stdin and stdout are, then echoes one line upper-cased.
SERVER = """
import os, stat, sys
kinds = ["sock" if stat.S_ISSOCK(os.fstat(fd).st_mode) else "other" for fd in (0, 1)]
line = sys.stdin.buffer.readline()
sys.stdout.buffer.write((" ".join(kinds) + " " + line.decode().upper()).encode())
sys.stdout.buffer.flush()
sys.exit(int(sys.stdin.buffer.read() == b"") + 2)  # 3: it saw the guard's EOF
"""


def test_the_server_speaks_on_the_socket_and_its_exit_is_the_guards_eof(tmp_path: Path) -> None:
    path = str(tmp_path / "mcp.sock")
    listener = bind_unix(path)
    listener.settimeout(20)
    relay_command = [sys.executable, "-m", "sandbox.stepside.agentworks_relay", "--socket", path]
    relay = subprocess.Popen([*relay_command, "--", sys.executable, "-c", SERVER], cwd=tmp_path)
    try:
        conn, _ = listener.accept()
        conn.settimeout(20)
        conn.sendall(b"hello\n")
        conn.shutdown(socket.SHUT_WR)  # the guard is done: the server reads EOF
        received = b""
        while chunk := conn.recv(4096):  # EOF once the server exited (the relay holds no copy)
            received += chunk
        assert received == b"sock sock HELLO\n"
        deadline = time.monotonic() + 20
        while relay.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.returncode == 3  # the server's own exit code, passed on
    finally:
        if relay.poll() is None:
            relay.kill()
        relay.wait()
        listener.close()
