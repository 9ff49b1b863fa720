"""An allowed MCP call's result kept in the run's recording: after its reply, off the
call's path (a real stdio server on a real unix socket, a thread; no engine)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types

from sandbox.contracts.config import McpServer
from sandbox.contracts.recording import BLOBS_DIR, INDEX_FILE, IndexLine, RecordingSettings
from sandbox.guard.mcp.calls import ToolCalls
from sandbox.guard.mcp.context import McpContext
from sandbox.guard.mcp.relay import Upstream
from sandbox.guard.recording import Reads, Recorder
from tests.conftest import in_process_guard
from tests.guard.mcp.mcpparts import stdio_server_at


def test_a_result_is_kept_after_the_reply_not_on_the_calls_path(tmp_path: Path) -> None:
    """When the call returns its result, nothing of the recording has touched the
    disk (no index, no blob: a slow disk cannot hold the reply); once the recorder
    is closed, the result is kept whole under its digest and listed."""
    guard = in_process_guard(tmp_path)
    root = tmp_path / "recording"
    recorder = Recorder(root, RecordingSettings())
    context = McpContext(guard.config, guard.log)
    context.reads = Reads(recorder, None)
    on_the_path: list[bool] = []

    async def main(listener: socket.socket) -> dict[str, Any]:
        upstream = Upstream(McpServer(name="s", command=["x"]), listener, os.getuid())
        calls = ToolCalls(context, upstream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(upstream.supervise)
            await upstream.wait_first_attempt()
            params = types.CallToolRequestParams(name="read", arguments={"q": 1})
            result = await calls.call_tool(params)
            on_the_path.append(root.exists())  # the reply would be written now
            tg.cancel_scope.cancel()
        return result

    try:
        with stdio_server_at(str(tmp_path / "mcp.sock")) as (listener, _):
            result = anyio.run(main, listener)
    finally:
        recorder.close()
        guard.log.close()
    assert on_the_path == [False]
    data = json.dumps(result, separators=(",", ":"), ensure_ascii=False).encode()
    digest = hashlib.sha256(data).hexdigest()
    (line,) = [
        IndexLine.model_validate_json(x) for x in (root / INDEX_FILE).read_text().splitlines()
    ]
    assert line.kept and line.sha256 == digest and line.bytes == len(data)
    assert line.kind == "mcp" and line.what == "mcp s/read"
    assert (root / BLOBS_DIR / digest).read_bytes() == data
