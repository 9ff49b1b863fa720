"""The MCP endpoint's hot path against the SDK's transport, call for call (no engine).

The same requests are sent twice to one guard endpoint, once with the hot path on
and once with it off (the SDK's streamable-HTTP transport answers), and must get
the same status, headers, body bytes and action-log lines. The upstream is a real
streamable-HTTP MCP server on loopback (a thread)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient
from starlette.types import Receive, Scope, Send

from sandbox.contracts.config import McpServer
from sandbox.contracts.wire import ActionLine
from sandbox.guard.actionlog import ActionLog
from sandbox.guard.mcp.endpoint import Endpoint
from sandbox.guard.mcp.hotpath import MAX_SESSIONS
from sandbox.guard.mcp.proxy import McpProxy
from tests.conftest import BRIDGE_TOKEN as TOKEN
from tests.conftest import guard_config
from tests.guard.mcp.mcpparts import JsonMcpServer

VERSION = "2025-11-25"
TOOLS = [
    {"name": "read", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}},
    {"name": "write", "inputSchema": {"type": "object"}},
    {"name": "boom", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}},
]


class _Upstream(JsonMcpServer):
    """A fake MCP server: three tools, one of which fails."""

    NAME = "up"
    SESSION_ID = "up-1"

    def answer(self, method: str | None, params: dict[str, Any]) -> dict[str, Any]:
        if method == "tools/list":
            return {"result": {"tools": TOOLS}}
        if method == "tools/call" and params.get("name") == "boom":
            return {"error": {"code": -32602, "message": "boom: bad arguments"}}
        if method == "tools/call":
            text = json.dumps(params.get("arguments"), sort_keys=True)
            return {"result": {"content": [{"type": "text", "text": f"read {text} é"}]}}
        return super().answer(method, params)


class _Counted:
    """The SDK's transport, counting what reaches it (to tell which path answered)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        await self.app(scope, receive, send)


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[tuple[TestClient, Endpoint, _Counted, Path]]:
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    actions = tmp_path / "actions.jsonl"
    actions.touch()
    config = guard_config(
        actions,
        mcp_servers=[McpServer(name="up", url=f"http://127.0.0.1:{http.server_address[1]}/")],
        mcp_dir=str(tmp_path / "mcp"),
    )
    proxy = McpProxy(config, ActionLog(str(actions), secrets=(TOKEN,), durability="group"))
    endpoint = proxy.endpoints["up"]
    counted = _Counted(endpoint.hot.sdk)
    endpoint.hot.sdk = counted

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with proxy.running():
            yield

    app = Starlette(routes=proxy.routes(), lifespan=lifespan)
    try:
        with TestClient(app, base_url="http://127.0.0.1:8790") as client:
            yield client, endpoint, counted, actions
    finally:
        http.shutdown()


HEADERS = {
    "Authorization": f"Bearer {TOKEN}",
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
}


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {
        "protocolVersion": VERSION,
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    },
}


def _open(client: TestClient) -> dict[str, str]:
    reply = client.post("/mcp/up", json=INITIALIZE, headers=HEADERS)
    assert reply.status_code == 200 and reply.json()["result"]["protocolVersion"] == VERSION
    session = {
        **HEADERS,
        "Mcp-Session-Id": reply.headers["mcp-session-id"],
        "Mcp-Protocol-Version": VERSION,
    }
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert client.post("/mcp/up", json=note, headers=session).status_code == 202
    return session


def _lines(actions: Path, start: int) -> list[dict[str, Any]]:
    """The log lines after `start`, without what differs between two runs of a call."""
    out = []
    for raw in actions.read_text().splitlines()[start:]:
        line = ActionLine.model_validate_json(raw).model_dump(exclude={"time", "duration_ms"})
        line["call_id"] = line["call_id"] is not None
        for key in ("lookup_ms", "upstream_ms"):
            line["detail"].pop(key, None)
        out.append(line)
    return out


def _both(
    client: TestClient,
    endpoint: Endpoint,
    counted: _Counted,
    actions: Path,
    body: bytes,
    headers: dict[str, str],
) -> tuple[int, list[dict[str, Any]]]:
    """Send `body` with the hot path on, then off; both answers and log lines must be
    equal. The number of requests the SDK saw with the hot path on, and the lines."""
    seen: list[tuple[int, dict[str, Any], bytes, list[dict[str, Any]]]] = []
    to_sdk = 0
    for enabled in (True, False):
        endpoint.hot.enabled = enabled
        before, start = counted.calls, len(actions.read_text().splitlines())
        reply = client.post("/mcp/up", content=body, headers=headers)
        if enabled:
            to_sdk = counted.calls - before
        # A request without a session gets a new one from the SDK, a new id each time.
        same_session = reply.headers.get("mcp-session-id") == headers.get("Mcp-Session-Id")
        kept = {"content-type": reply.headers.get("content-type"), "session": same_session}
        seen.append((reply.status_code, kept, reply.content, _lines(actions, start)))
    endpoint.hot.enabled = True
    assert seen[0] == seen[1]
    return to_sdk, seen[0][3]


def _request(rid: Any, method: str, params: dict[str, Any] | None = None) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
    if params is not None:
        message["params"] = params
    return json.dumps(message).encode()


def test_plain_requests_are_answered_by_the_hot_path_as_the_sdk_answers_them(
    guard: tuple[TestClient, Endpoint, _Counted, Path],
) -> None:
    client, endpoint, counted, actions = guard
    session = _open(client)
    read = _request(1, "tools/call", {"name": "read", "arguments": {"q": "x", "n": [1, 2]}})
    to_sdk, lines = _both(client, endpoint, counted, actions, read, session)
    assert to_sdk == 0
    assert [(ln["event"], ln["decision"], ln["outcome"]) for ln in lines] == [
        ("start", "allow", None),
        ("outcome", "allow", "ok"),
    ]
    assert lines[0]["tool"] == "mcp:up/read" and lines[0]["arguments"] == {"q": "x", "n": [1, 2]}
    stub = _request("s-2", "tools/call", {"name": "write", "arguments": {"to": "a"}})
    to_sdk, lines = _both(client, endpoint, counted, actions, stub, session)
    assert to_sdk == 0
    assert [(ln["event"], ln["decision"]) for ln in lines] == [("call", "stub")]
    boom = _request(3, "tools/call", {"name": "boom"})
    to_sdk, lines = _both(client, endpoint, counted, actions, boom, session)
    assert to_sdk == 0 and lines[1]["outcome"] == "error"
    for body in (_request(4, "tools/list"), _request(5, "tools/list", {}), _request(6, "ping")):
        to_sdk, _ = _both(client, endpoint, counted, actions, body, session)
        assert to_sdk == 0, body
    unknown = _request(7, "tools/call", {"name": "nope", "arguments": {}})
    assert _both(client, endpoint, counted, actions, unknown, session)[0] == 0
    # JSON nulls where the SDK takes None, and a cursor.
    for body in (
        _request(8, "tools/call", {"name": "read", "arguments": None}),
        _request(9, "tools/call", {"name": "read"}),
        _request(10, "tools/list", {"cursor": None}),
        _request(11, "tools/list", {"cursor": "c1"}),
    ):
        assert _both(client, endpoint, counted, actions, body, session)[0] == 0, body
    # What the step's client sees: the stub reply, the server's error, the result.
    answers = [
        client.post("/mcp/up", content=body, headers=session).json() for body in (read, stub, boom)
    ]
    assert answers[0]["result"]["content"][0]["text"] == 'read {"n": [1, 2], "q": "x"} é'
    assert "write was NOT run" in answers[1]["result"]["content"][0]["text"]
    assert answers[2]["error"] == {"code": -32602, "message": "boom: bad arguments"}


def test_everything_else_falls_back_to_the_sdk(
    guard: tuple[TestClient, Endpoint, _Counted, Path],
) -> None:
    client, endpoint, counted, actions = guard
    session = _open(client)
    call = {"name": "read", "arguments": {}}
    deep: Any = "x"
    for _ in range(400):
        deep = [deep]
    odd_bodies = [
        _request(1, "tools/call", {**call, "_meta": {"progressToken": 1}}),
        json.dumps([json.loads(_request(2, "tools/call", call))]).encode(),  # a batch
        b'{"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 9}}',
        _request(3, "resources/list"),
        _request(4, "logging/setLevel", {"level": "debug"}),
        _request(5, "tools/call", {"name": 7}),
        _request(True, "ping"),
        _request(6, "ping", {"extra": 1}),
        _request(7.5, "ping"),
        json.dumps({"jsonrpc": "2.0", "id": 8, "method": "ping", "x": 1}).encode(),
        json.dumps({"jsonrpc": "1.0", "id": 8, "method": "ping"}).encode(),
        _request(9, "tools/call", {"name": "read", "arguments": deep}),
        b'{"jsonrpc": "2.0", "id": 10, "method": "ping"',
        b"",
    ]
    for body in odd_bodies:
        assert _both(client, endpoint, counted, actions, body, session)[0] == 1, body
    ping = _request(11, "ping")
    odd_headers = [
        {**session, "Mcp-Session-Id": "0" * 32},
        {k: v for k, v in session.items() if k != "Mcp-Session-Id"},
        {**session, "Mcp-Protocol-Version": "2025-06-18"},
        {**session, "Mcp-Protocol-Version": "2026-07-28"},
        {k: v for k, v in session.items() if k != "Mcp-Protocol-Version"},
        {**session, "Host": "evil.example:8790"},
        {**session, "Origin": "http://evil.example"},
        {**session, "Accept": "text/html"},
        {**session, "Content-Type": "text/plain"},
    ]
    for headers in odd_headers:
        assert _both(client, endpoint, counted, actions, ping, headers)[0] == 1, headers
    # The session ended (DELETE): its id is unknown to both paths from then on.
    assert client.delete("/mcp/up", headers=session).status_code == 200
    to_sdk, _ = _both(client, endpoint, counted, actions, ping, session)
    assert to_sdk == 1
    assert client.post("/mcp/up", content=ping, headers=session).status_code == 404


def test_sessions_are_capped_and_the_refusal_is_logged(
    guard: tuple[TestClient, Endpoint, _Counted, Path],
) -> None:
    client, endpoint, _, actions = guard
    assert endpoint.manager.session_idle_timeout is None  # no expiry under the hot path
    for _ in range(MAX_SESSIONS):
        _open(client)
    assert client.post("/mcp/up", json=INITIALIZE, headers=HEADERS).status_code == 503
    (line,) = _lines(actions, 0)
    assert (line["decision"], line["category"], line["tool"]) == ("refuse", "request", "mcp:up")
    assert "too many open MCP sessions" in line["reason"]
