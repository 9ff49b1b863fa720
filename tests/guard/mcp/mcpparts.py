"""What the MCP tests share about the servers of the outside world: the output
schemas real servers declare, and a fake streamable-HTTP server to subclass. A
helper, not a test module, so no test file imports another."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

from sandbox.guard.listeners import bind_unix

# Output schemas as real servers declare them (filesystem, memory, time), and the
# JSON-Schema features a server may use.
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"content": {"type": "string"}},
        "required": ["content"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "entities": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "observations": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["name", "observations"],
                },
            },
            "relations": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["entities", "relations"],
    },
    {
        "$defs": {
            "TimeResult": {
                "type": "object",
                "properties": {
                    "timezone": {"type": "string"},
                    "datetime": {"type": "string", "format": "date-time"},
                    "is_dst": {"type": "boolean"},
                },
                "required": ["timezone", "datetime", "is_dst"],
            }
        },
        "type": "object",
        "properties": {
            "source": {"$ref": "#/$defs/TimeResult"},
            "target": {"$ref": "#/$defs/TimeResult"},
        },
        "required": ["source", "target"],
    },
    {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 3, "maximum": 9, "multipleOf": 3},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "status": {"enum": ["queued", "sent"]},
            "kind": {"const": "proposal"},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
            "id": {"type": "string", "format": "uuid"},
            "code": {"type": "string", "minLength": 25, "maxLength": 30},
            "maybe": {"type": ["null", "string"]},
            "either": {"oneOf": [{"type": "integer", "minimum": 5}, {"type": "string"}]},
            "both": {
                "allOf": [
                    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
                ]
            },
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
            "success": {"type": "boolean"},
        },
        "required": [
            "count",
            "ratio",
            "status",
            "kind",
            "tags",
            "id",
            "code",
            "maybe",
            "either",
            "both",
            "pair",
            "success",
        ],
        "additionalProperties": False,
    },
    {"type": "object", "minProperties": 1, "properties": {"x": {"type": "string"}}},
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["code"],
    },
]


class JsonMcpServer(BaseHTTPRequestHandler):
    """A fake streamable-HTTP MCP server (JSON replies, no event stream) for the
    outside world: it answers `initialize` as `NAME`, accepts notifications, and
    leaves every other request to `answer` (a JSON-RPC `result` or `error` member)."""

    NAME = "fake"
    SESSION_ID = "s1"

    def log_message(self, format: str, *args: object) -> None:
        return

    def do_GET(self) -> None:  # no standalone event stream
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_DELETE(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rid, method = message.get("id"), message.get("method")
        if rid is None:
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        params = message.get("params") or {}
        if method == "initialize":
            member: dict[str, Any] = {
                "result": {
                    "protocolVersion": params["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": self.NAME, "version": "1"},
                }
            }
        else:
            member = self.answer(method, params)
        data = json.dumps({"jsonrpc": "2.0", "id": rid, **member}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Mcp-Session-Id", self.SESSION_ID)
        self.end_headers()
        self.wfile.write(data)

    def answer(self, method: str | None, params: dict[str, Any]) -> dict[str, Any]:
        return {"error": {"code": -32601, "message": "no"}}


READ_TOOL = [
    {"name": "read", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}}
]


def stdio_server(conn: socket.socket, seen: list[dict[str, Any]]) -> None:
    """A stdio server on the guard's socket (as its relay hands it over): one tool,
    `read`, annotated read-only, whose call answers "ok"; every message it reads is
    kept in `seen`."""
    buffer = b""
    try:
        while True:
            while b"\n" not in buffer:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buffer += chunk
            line, _, buffer = buffer.partition(b"\n")
            message = json.loads(line)
            seen.append(message)
            if "id" not in message:
                continue
            result: dict[str, Any] = {"content": [{"type": "text", "text": "ok"}]}
            if message["method"] == "initialize":
                result = {
                    "protocolVersion": message["params"]["protocolVersion"],
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "s", "version": "1"},
                }
            elif message["method"] == "tools/list":
                result = {"tools": READ_TOOL}
            reply = {"jsonrpc": "2.0", "id": message["id"], "result": result}
            conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:
        return


@contextlib.contextmanager
def stdio_server_at(path: str) -> Iterator[tuple[socket.socket, list[dict[str, Any]]]]:
    """`stdio_server` in a thread, connected to the guard's listener bound at `path`:
    yields the listener (for the relay) and the messages the server read; closed and
    joined on exit."""
    listener = bind_unix(path)
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(path)
    seen: list[dict[str, Any]] = []
    thread = threading.Thread(target=stdio_server, args=(conn, seen), daemon=True)
    thread.start()
    try:
        yield listener, seen
    finally:
        conn.close()
        thread.join(timeout=5)
