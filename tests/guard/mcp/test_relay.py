"""The relay: its reading of the SDK's errors (which ones say the session is gone), and
the requests a judged call sends, as a stdio server and a URL server read them (real
servers: a thread on a real unix socket, an HTTP server on loopback; no engine)."""

from __future__ import annotations

import os
import socket
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import anyio
import mcp_types as types
from mcp.shared.exceptions import MCPError

from sandbox.contracts.config import McpServer
from sandbox.guard.mcp.calls import ToolCalls
from sandbox.guard.mcp.context import McpContext
from sandbox.guard.mcp.relay import Upstream, maybe_lost
from tests.conftest import in_process_guard
from tests.guard.mcp.mcpparts import READ_TOOL, JsonMcpServer, stdio_server_at


def test_lost_session_spellings() -> None:
    closed = MCPError(code=-32000, message="Connection closed")
    assert maybe_lost(closed, stdio=True) and maybe_lost(closed, stdio=False)
    gone = MCPError(code=-32600, message="Session terminated")
    assert maybe_lost(gone, stdio=False) and not maybe_lost(gone, stdio=True)
    assert not maybe_lost(MCPError(code=-32601, message="Method not found"), stdio=False)


# -- what a judged call sends: the lookup and the call, as the server reads them --------


STEP_PARAMS = {"name": "read", "arguments": {"q": "x", "none": None}, "_meta": {"progressToken": 7}}


class _UrlServer(JsonMcpServer):
    seen: ClassVar[list[dict[str, Any]]] = []

    def answer(self, method: str | None, params: dict[str, Any]) -> dict[str, Any]:
        self.seen.append({"method": method, "params": params})
        if method == "tools/list":
            return {"result": {"tools": READ_TOOL}}
        return {"result": {"content": [{"type": "text", "text": "ok"}]}}


def _judged_call(tmp_path: Path, server: McpServer, listener: socket.socket | None) -> Any:
    guard = in_process_guard(tmp_path)
    upstream = Upstream(server, listener, os.getuid() if listener is not None else None)
    calls = ToolCalls(McpContext(guard.config, guard.log), upstream)

    async def main() -> Any:
        async with anyio.create_task_group() as tg:
            tg.start_soon(upstream.supervise)
            await upstream.wait_first_attempt()
            params = types.CallToolRequestParams.model_validate(STEP_PARAMS)
            result = await calls.call_tool(params)
            tg.cancel_scope.cancel()
        return result

    try:
        return anyio.run(main)
    finally:
        guard.log.close()


def test_a_judged_call_sends_the_lookup_and_only_name_and_arguments(tmp_path: Path) -> None:
    """The live lookup is a first `tools/list` page with empty params; the call carries
    the step's `name` and `arguments` exactly (a null argument too) and nothing else it
    sent (`_meta`): the same requests to a stdio server and to a URL server."""
    with stdio_server_at(str(tmp_path / "mcp.sock")) as (listener, seen):
        result = _judged_call(tmp_path, McpServer(name="s", command=["x"]), listener)
    assert result["content"] == [{"type": "text", "text": "ok"}]
    asked = [m for m in seen if m.get("method") in ("tools/list", "tools/call")]
    ids = [m["id"] for m in asked]
    assert asked == [
        {"jsonrpc": "2.0", "id": ids[0], "method": "tools/list", "params": {}},
        {
            "jsonrpc": "2.0",
            "id": ids[1],
            "method": "tools/call",
            "params": {"name": "read", "arguments": {"q": "x", "none": None}},
        },
    ]

    http = ThreadingHTTPServer(("127.0.0.1", 0), _UrlServer)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{http.server_address[1]}/"
        (tmp_path / "url").mkdir()
        result = _judged_call(tmp_path / "url", McpServer(name="u", url=url), None)
    finally:
        http.shutdown()
    assert result["content"] == [{"type": "text", "text": "ok"}]
    assert [m for m in _UrlServer.seen if m["method"] in ("tools/list", "tools/call")] == [
        {"method": m["method"], "params": m["params"]} for m in asked
    ]
