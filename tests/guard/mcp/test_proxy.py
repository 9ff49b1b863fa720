"""The MCP surface of the guard over HTTP, with servers that die or answer too much (no engine)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from sandbox.contracts.config import McpServer
from sandbox.contracts.wire import ActionLine
from sandbox.guard import limits
from sandbox.guard.app import build_app
from sandbox.guard.bridge.routes import Guard
from sandbox.guard.listeners import bind_unix
from sandbox.stepside import agentworks_mcp as mcp_client
from tests.conftest import BRIDGE_TOKEN, in_process_guard
from tests.guard.mcp.mcpparts import JsonMcpServer


def test_step_helper_parses_sse_bodies() -> None:
    body = 'event: message\ndata: {"jsonrpc": "2.0", "id": 1,\ndata:  "result": {}}\n\n: ping\n\n'
    assert mcp_client._sse_messages(body) == [{"jsonrpc": "2.0", "id": 1, "result": {}}]
    assert (
        mcp_client.text_of({"content": [{"type": "text", "text": "a"}, {"type": "image"}]}) == "a"
    )


# --------------------------------------------------------------------------- HTTP surface


def _app(tmp_path: Path, servers: list[McpServer]) -> tuple[Any, Path]:
    data = tmp_path / "data"
    data.mkdir()
    listeners = {}
    for server in servers:
        folder = tmp_path / "mcp" / server.name
        folder.mkdir(parents=True)
        # A server whose container started and died at once: it connects, then is gone.
        listeners[server.name] = bind_unix(str(folder / "mcp.sock"))
        with socket.socket(socket.AF_UNIX) as dying:
            dying.connect(str(folder / "mcp.sock"))
    guard = in_process_guard(
        tmp_path,
        secrets=(BRIDGE_TOKEN,),
        data_dir=str(data),
        mcp_servers=servers,
        mcp_dir=str(tmp_path / "mcp"),
    )
    return build_app(Guard(guard.config, guard.log), mcp_listeners=listeners), guard.actions


def test_endpoints_need_the_token_and_unknown_servers_are_refused(tmp_path: Path) -> None:
    broken = McpServer(name="broken", command=["/nonexistent/mcp-server"])
    app, actions = _app(tmp_path, [broken])
    auth = {"Authorization": "Bearer " + "b" * 24}
    with TestClient(app, base_url="http://127.0.0.1:8790") as client:
        assert client.get("/mcp").status_code == 401
        listing = client.get("/mcp", headers=auth).json()
        assert listing == {
            "servers": [{"name": "broken", "url": "http://127.0.0.1:8790/mcp/broken"}]
        }
        assert client.post("/mcp/broken", json={}).status_code == 401
        assert client.post("/mcp/nope", json={}, headers=auth).status_code == 404
        # A server that cannot start: every tools/call is a stub with the reason.
        headers = {**auth, "Accept": "application/json, text/event-stream"}
        init = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        reply = client.post("/mcp/broken", json=init, headers=headers)
        session = {**headers, "Mcp-Session-Id": reply.headers["mcp-session-id"]}
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "x"}}
        result = client.post("/mcp/broken", json=call, headers=session).json()["result"]
        assert result["isError"] is False
        assert (
            "x was NOT run (annotation lookup failed: the server is not running"
            in (result["content"][0]["text"])
        )
        listing_error = client.post(
            "/mcp/broken", json={"jsonrpc": "2.0", "id": 3, "method": "tools/list"}, headers=session
        ).json()
        assert "not running" in listing_error["error"]["message"]
    lines = [ActionLine.model_validate_json(x) for x in actions.read_text().splitlines()]
    assert [(ln.decision, ln.category) for ln in lines] == [
        ("refuse", "request"),
        ("refuse", "request"),
        ("refuse", "request"),
        ("stub", "mcp"),
    ]
    assert "no MCP server" in lines[2].reason
    assert lines[3].tool == "mcp:broken/x" and lines[3].detail["listed"] is False
    assert lines[3].event == "call"


def test_oversized_requests_get_an_http_error_and_a_line(tmp_path: Path) -> None:
    """Bodies past MAX_REQUEST_BYTES (declared or streamed) and headers past
    MAX_HEADER_BYTES, on the bridge and the MCP paths alike: refused, logged, and
    the guard goes on serving."""
    app, actions = _app(tmp_path, [McpServer(name="files", command=["gone"])])
    auth = {"Authorization": "Bearer " + "b" * 24}
    big = b"x" * (limits.MAX_REQUEST_BYTES + 1)

    def streamed() -> Iterator[bytes]:
        for start in range(0, len(big), 65536):
            yield big[start : start + 65536]

    with TestClient(app, base_url="http://127.0.0.1:8790") as client:
        declared = client.post("/v1/tools/call", content=big, headers=auth)
        assert declared.status_code == 413
        assert "larger than 4 MiB" in declared.json()["error"]
        mcp_headers = {**auth, "Accept": "application/json, text/event-stream"}
        chunked = client.post("/mcp/files", content=streamed(), headers=mcp_headers)
        assert chunked.status_code == 413
        headers = {**auth, "X-Filler": "f" * (limits.MAX_HEADER_BYTES + 1)}
        assert client.post("/v1/tools/call", json={"tool": "x"}, headers=headers).status_code == 431
        ok = client.post("/v1/tools/call", json={"tool": "notify_user"}, headers=auth)
        assert ok.status_code == 200 and ok.json()["decision"] == "stub"
    lines = [ActionLine.model_validate_json(x) for x in actions.read_text().splitlines()]
    assert [(ln.tool, ln.decision, ln.category) for ln in lines] == [
        ("/v1/tools/call", "refuse", "request"),
        ("mcp:/mcp/files", "refuse", "request"),
        ("/v1/tools/call", "refuse", "request"),
        ("notify_user", "stub", "messaging"),
    ]
    assert "headers larger than 16 KiB" in lines[2].reason


class _HugeReplies(JsonMcpServer):
    """A fake MCP server whose one tool answers past the cap."""

    NAME = "huge"

    def answer(self, method: str | None, params: dict[str, Any]) -> dict[str, Any]:
        if method == "tools/list":
            tool = {"name": "huge", "inputSchema": {"type": "object"}}
            return {"result": {"tools": [{**tool, "annotations": {"readOnlyHint": True}}]}}
        if method == "tools/call":
            text = "h" * (limits.MAX_MCP_MESSAGE_BYTES + 1024)
            return {"result": {"content": [{"type": "text", "text": text}]}}
        return super().answer(method, params)


def test_a_url_servers_reply_past_the_cap_is_a_tool_error(tmp_path: Path) -> None:
    http = ThreadingHTTPServer(("127.0.0.1", 0), _HugeReplies)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{http.server_address[1]}/mcp"
        app, actions = _app(tmp_path, [McpServer(name="huge", url=url)])
        headers = {
            "Authorization": "Bearer " + "b" * 24,
            "Accept": "application/json, text/event-stream",
        }
        init = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        with TestClient(app, base_url="http://127.0.0.1:8790") as client:
            reply = client.post("/mcp/huge", json=init, headers=headers)
            session = {**headers, "Mcp-Session-Id": reply.headers["mcp-session-id"]}
            call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "huge"}}
            result = client.post("/mcp/huge", json=call, headers=session).json()["result"]
    finally:
        http.shutdown()
    assert result["isError"] is True
    assert "larger than the guard's cap of 8 MiB" in result["content"][0]["text"]
    start, outcome = [ActionLine.model_validate_json(x) for x in actions.read_text().splitlines()]
    assert (start.event, start.decision, outcome.event, outcome.outcome) == (
        "start",
        "allow",
        "outcome",
        "error",
    )
    assert outcome.detail["reply_too_large"] is True
