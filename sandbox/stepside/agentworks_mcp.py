"""A tiny MCP client for scripts inside the step (stdlib only).

Installed in the step image as `agentworks_mcp`. Every MCP server of the
workflow is reachable from the step only through the guard, one streamable-HTTP
endpoint per server at `$AGENTWORKS_MCP_URL/<server name>`, authenticated with
the run's bridge token. This speaks the protocol's JSON-RPC over HTTP by hand
(initialize handshake, `Mcp-Session-Id`, JSON or SSE replies), so a script
needs no SDK:

    import agentworks_mcp
    with agentworks_mcp.connect("files") as files:
        tools = files.list_tools()
        result = files.call_tool("read_text_file", {"path": "/data/notes.txt"})
        print(agentworks_mcp.text_of(result))

In test mode a stubbed call is a normal successful result whose text is the
stub reply (`TEST MODE: <tool> was NOT run (...)`).
"""

from __future__ import annotations

import itertools
import json
import os
import urllib.error
import urllib.request
from types import TracebackType
from typing import Any

PROTOCOL_VERSION = "2025-11-25"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


class McpError(RuntimeError):
    """The endpoint could not be reached, or answered with an error."""

    def __init__(self, message: str, *, code: int | None = None, status: int | None = None):
        super().__init__(message)
        self.code = code
        self.status = status


def servers(*, timeout_s: float = 30.0) -> list[str]:
    """The names of the MCP servers this run proxies."""
    url, token = _base()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise McpError(f"{url} answered {exc.code}", status=exc.code) from None
    except (urllib.error.URLError, OSError) as exc:
        raise McpError(f"{url} not reachable: {exc}") from None
    return [str(s["name"]) for s in body.get("servers", [])]


def connect(server: str, *, timeout_s: float = 120.0) -> Session:
    """An initialized session with one server (use it as a context manager)."""
    session = Session(server, timeout_s=timeout_s)
    session.initialize()
    return session


def text_of(result: dict[str, Any]) -> str:
    """The text blocks of a `CallToolResult`, joined."""
    parts = [
        str(block.get("text", ""))
        for block in result.get("content", [])
        if isinstance(block, dict) and block.get("type") == "text"
    ]
    return "\n".join(parts)


def _base() -> tuple[str, str]:
    url = os.environ.get("AGENTWORKS_MCP_URL")
    if not url:
        raise McpError("AGENTWORKS_MCP_URL is not set: no MCP proxy in this environment")
    return url.rstrip("/"), os.environ.get("AGENTWORKS_BRIDGE_TOKEN", "")


class Session:
    """One MCP session with one server through the guard."""

    def __init__(self, server: str, *, timeout_s: float = 120.0) -> None:
        base, self._token = _base()
        self.url = f"{base}/{server}"
        self.server = server
        self.timeout_s = timeout_s
        self.session_id: str | None = None
        self.server_info: dict[str, Any] = {}
        self._ids = itertools.count(1)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def initialize(self) -> dict[str, Any]:
        result = self.request(
            "initialize",
            {
                "protocolVersion": PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "agentworks_mcp", "version": "1"},
            },
        )
        self.server_info = result
        self.notify("notifications/initialized")
        return result

    def list_tools(self) -> list[dict[str, Any]]:
        tools: list[dict[str, Any]] = []
        cursor: str | None = None
        for _ in range(100):
            page = self.request("tools/list", {"cursor": cursor} if cursor else {})
            tools.extend(page.get("tools", []))
            cursor = page.get("nextCursor")
            if not cursor:
                break
        return tools

    def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("tools/call", {"name": name, "arguments": arguments or {}})

    def read_resource(self, uri: str) -> dict[str, Any]:
        return self.request("resources/read", {"uri": uri})

    def get_prompt(self, name: str, arguments: dict[str, str] | None = None) -> dict[str, Any]:
        return self.request("prompts/get", {"name": name, "arguments": arguments or {}})

    def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One JSON-RPC request; its result, or McpError with the JSON-RPC error."""
        request_id = next(self._ids)
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        for reply in self._post(message):
            if reply.get("id") != request_id:
                continue  # a notification or a server request: not ours
            if "error" in reply:
                error = reply["error"]
                raise McpError(f"{method}: {error.get('message', 'error')}", code=error.get("code"))
            result: dict[str, Any] = reply.get("result", {})
            return result
        raise McpError(f"{method}: no reply from {self.url}")

    def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        for _ in self._post(message):
            pass

    def close(self) -> None:
        if self.session_id is None:
            return
        request = urllib.request.Request(self.url, headers=self._headers(), method="DELETE")
        try:
            with _OPENER.open(request, timeout=10):
                pass
        except (urllib.error.URLError, OSError):
            pass
        self.session_id = None

    # -- HTTP --------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        headers = {
            "Authorization": f"Bearer {self._token}",
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
        }
        if self.session_id is not None:
            headers["Mcp-Session-Id"] = self.session_id
            headers["Mcp-Protocol-Version"] = PROTOCOL_VERSION
        return headers

    def _post(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        request = urllib.request.Request(
            self.url, data=json.dumps(message).encode(), headers=self._headers(), method="POST"
        )
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as response:
                session_id = response.headers.get("Mcp-Session-Id")
                if session_id:
                    self.session_id = session_id
                kind = response.headers.get("Content-Type", "")
                body = response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            try:
                error = json.loads(detail).get("error", {})
                if isinstance(error, dict) and "code" in error:
                    raise McpError(
                        f"{self.url} answered {exc.code}: {error.get('message')}",
                        code=error.get("code"),
                        status=exc.code,
                    ) from None
            except ValueError:
                pass
            raise McpError(f"{self.url} answered {exc.code}: {detail}", status=exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            raise McpError(f"{self.url} not reachable: {exc}") from None
        if not body.strip():
            return []
        if kind.startswith("text/event-stream"):
            return _sse_messages(body)
        parsed = json.loads(body)
        return parsed if isinstance(parsed, list) else [parsed]


def _sse_messages(body: str) -> list[dict[str, Any]]:
    """The JSON-RPC messages in an SSE body (`data:` lines, events split by blank lines)."""
    messages: list[dict[str, Any]] = []
    data: list[str] = []
    for line in [*body.splitlines(), ""]:
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif not line and data:
            try:
                parsed = json.loads("\n".join(data))
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                messages.append(parsed)
            data = []
    return messages
