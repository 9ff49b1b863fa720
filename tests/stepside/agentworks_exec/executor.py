"""The step executor as a real subprocess for tests: started with a port, a token and a root,
called over real HTTP (``python -m sandbox.stepside.agentworks_exec -- <cmd>``).

No Docker and no mocks: the fixtures in this folder's conftest start it and wait for
``/v1/health``; tests call tools with urllib.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests import paths

REPO = paths.REPO
TOKEN = "t0k3n-for-tests-0123456789abcdef"
DEADLINE_S = 15.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    token: str | None = TOKEN,
    timeout: float = 30,
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@dataclass
class Exec:
    proc: subprocess.Popen[bytes]
    port: int
    root: Path

    def call(self, tool: str, **arguments: Any) -> dict[str, Any]:
        body = json.dumps({"tool": tool, "arguments": arguments}).encode()
        status, reply = http(self.port, "POST", "/v1/exec", body)
        assert status == 200, reply
        assert set(reply) == {"text", "data", "is_error"}
        return dict(reply)


def healthy(port: int, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"executor exited early with {proc.returncode}"
    try:
        return http(port, "GET", "/v1/health", token=None, timeout=2) == (200, {"ok": True})
    except OSError:
        return False


ExecFactory = Callable[..., Exec]
