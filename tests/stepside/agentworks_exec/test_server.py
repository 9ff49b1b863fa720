"""The executor's HTTP layer (`server.py`): health, token, body limits, unknown tools and paths.

Each test starts the executor as a real subprocess and calls it over real HTTP.
"""

from __future__ import annotations

import json

import pytest

from tests.stepside.agentworks_exec.executor import (
    TOKEN,
    Exec,
    http,
)


def test_health_needs_no_token(ex: Exec) -> None:
    assert http(ex.port, "GET", "/v1/health", token=None) == (200, {"ok": True})


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_bad_token_is_401(ex: Exec, token: str | None) -> None:
    body = json.dumps({"tool": "list_dir", "arguments": {}}).encode()
    status, reply = http(ex.port, "POST", "/v1/exec", body, token=token)
    assert status == 401
    assert "error" in reply


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"arguments": {}}',
        b'{"tool": "", "arguments": {}}',
        b'{"tool": 3}',
        b'{"tool": "list_dir", "arguments": []}',
        b'{"tool": "list_dir", "extra": 1}',
    ],
)
def test_malformed_body_is_400(ex: Exec, body: bytes) -> None:
    status, reply = http(ex.port, "POST", "/v1/exec", body)
    assert status == 400
    assert reply["error"]


def test_oversized_body_is_413(ex: Exec) -> None:
    body = b'{"tool": "list_dir", "arguments": {"x": "' + b"a" * (4 * 1024 * 1024) + b'"}}'
    status, reply = http(ex.port, "POST", "/v1/exec", body)
    assert status == 413
    assert "larger" in reply["error"]
    # The server is still fine afterwards.
    assert ex.call("list_dir")["is_error"] is False


def test_arguments_default_and_unknown_tool(ex: Exec) -> None:
    status, reply = http(ex.port, "POST", "/v1/exec", b'{"tool": "list_dir"}')
    assert status == 200 and reply["is_error"] is False
    reply = ex.call("send_email", to="x")
    assert reply["is_error"] is True
    assert "unknown local tool" in reply["text"]


def test_unknown_endpoint_is_404(ex: Exec) -> None:
    assert http(ex.port, "GET", "/v1/nope")[0] == 404
    assert http(ex.port, "POST", "/v1/nope", b"{}")[0] == 404
