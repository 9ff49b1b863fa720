"""The executor's HTTP server on 127.0.0.1: bearer-token checked, quiet (stderr is the step's).

A reply leaves in one write on a socket without Nagle: written as a head and then a
body, Nagle held the body back until the guard acknowledged the head, which its
delayed ACK put off by ~40 ms a call (tests/guard/bridge/test_executor.py counts the segments).
"""

from __future__ import annotations

import hmac
import json
import socket
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final, cast

from .executor import Executor

MAX_REQUEST_BYTES: Final = 4 * 1024 * 1024  # same as sandbox.contracts.wire.MAX_REQUEST_BYTES


MAX_DRAIN_BYTES: Final = 16 * 1024 * 1024  # read and drop an oversized body up to this


SOCKET_TIMEOUT_S: Final = 60.0


REPLY_BUFFER_BYTES: Final = 256 * 1024  # a reply up to this size leaves in one write


class ExecServer(ThreadingHTTPServer):
    """The HTTP API on a socket that already listens (`supervisor.listen`, made before
    the step starts; this module and the tools load at the first connection)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, listener: socket.socket, token: str, executor: Executor) -> None:
        self.expected_auth = f"Bearer {token}".encode()
        self.executor = executor
        super().__init__(listener.getsockname(), _Handler, bind_and_activate=False)
        self.socket.close()  # the one the base class made: the listener replaces it
        self.socket = listener

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Stay quiet: stderr is the step's."""


class _Handler(BaseHTTPRequestHandler):
    server_version = "agentworks-exec/1"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S
    disable_nagle_algorithm = True
    # Buffered: the head and the body go out in one write (the flush in `_reply`); a
    # reply larger than the buffer is written as it comes, each part without delay.
    wbufsize = REPLY_BUFFER_BYTES

    def log_message(self, format: str, *args: Any) -> None:
        """No per-request lines: stderr is the step's own output."""

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(payload)
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path == "/v1/health":
            self._reply(200, {"ok": True})
        elif path == "/v1/exec":
            self._reply(405, {"error": "use POST for /v1/exec"})
        else:
            self._reply(404, {"error": f"no such endpoint: {path}"})

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path != "/v1/exec":
            self._discard_body()
            self._reply(404, {"error": f"no such endpoint: {path}"})
            return
        server = cast(ExecServer, self.server)
        given = self.headers.get("Authorization", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, server.expected_auth):
            self._discard_body()
            self._reply(401, {"error": "missing or wrong bearer token"})
            return
        length = self._content_length()
        if length is None:
            return
        if length > MAX_REQUEST_BYTES:
            self._discard_body()
            self._reply(413, {"error": f"request body is larger than {MAX_REQUEST_BYTES} bytes"})
            return
        try:
            body = self.rfile.read(length)
        except OSError:
            self.close_connection = True
            return
        request = _parse_exec_request(body)
        if isinstance(request, str):
            self._reply(400, {"error": request})
            return
        tool, arguments = request
        self._reply(200, server.executor.call(tool, arguments))

    def _content_length(self) -> int | None:
        raw = self.headers.get("Content-Length")
        if raw is None:
            self.close_connection = True
            self._reply(411, {"error": "Content-Length is required"})
            return None
        try:
            length = int(raw)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            self._reply(400, {"error": "invalid Content-Length"})
            return None
        return length

    def _discard_body(self) -> None:
        """Read and drop a body we will not use (so the client sees our reply, not a reset)."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if length < 0 or length > MAX_DRAIN_BYTES:
            self.close_connection = True
            return
        try:
            while length > 0:
                chunk = self.rfile.read(min(length, 65536))
                if not chunk:
                    break
                length -= len(chunk)
        except OSError:
            self.close_connection = True


def _parse_exec_request(body: bytes) -> tuple[str, dict[str, Any]] | str:
    """(tool, arguments) of an ExecRequest body, or the reason it is malformed."""
    try:
        request = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"body is not valid JSON: {exc}"
    if not isinstance(request, dict):
        return "body must be a JSON object"
    extra = sorted(set(request) - {"tool", "arguments"})
    if extra:
        return f"unexpected fields: {', '.join(extra)}"
    tool = request.get("tool")
    if not isinstance(tool, str) or not tool:
        return "'tool' must be a non-empty string"
    arguments = request.get("arguments", {})
    if not isinstance(arguments, dict):
        return "'arguments' must be a JSON object"
    return tool, arguments
