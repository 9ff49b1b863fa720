"""The caps on a request to the guard's bridge and MCP port, and the line of one
refused for its shape.

The raw bridge front and `CappedRequests` (around the framework app that serves
MCP) ask the same `refused_head`, so both refuse the same heads alike and answer
byte for byte alike (`json_bytes`).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from sandbox.contracts.guardconfig import MCP_PATH
from sandbox.guard import limits
from sandbox.guard.actionlog import ActionLog

if TYPE_CHECKING:  # the web stack comes after the guard's DNS serves (`sandbox.guard.startup`)
    from starlette.types import ASGIApp, Message, Receive, Scope, Send


def json_bytes(content: Any) -> bytes:
    """JSON as the framework's JSONResponse renders it (compact, UTF-8), so every entry
    answers byte for byte alike."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode()


def too_large_request() -> str:
    return f"request larger than {limits.mib(limits.MAX_REQUEST_BYTES)} (the guard's cap)"


def refused_head(headers: list[tuple[bytes, bytes]]) -> tuple[int, str] | None:
    """Why a request is refused on its head alone, or None: 431 for header lines past
    the cap, 413 for a declared body past it (the first Content-Length). The raw front
    and `CappedRequests` both ask here, so both refuse the same heads alike."""
    size = 0
    declared = None
    for name, value in headers:  # one pass, no generator: every request of the port
        size += len(name) + len(value) + 4
        if declared is None and name == b"content-length":
            declared = value
    if size > limits.MAX_HEADER_BYTES:
        return 431, (
            f"request headers larger than {limits.mib(limits.MAX_HEADER_BYTES)} (the guard's cap)"
        )
    declared = declared or b""
    if declared.isdigit() and int(declared) > limits.MAX_REQUEST_BYTES:
        return 413, too_large_request()
    return None


class CappedRequests:
    """ASGI wrapper around the whole bridge and MCP port: the step's request heads and
    bodies have caps, and passing one is an HTTP error with a line, never memory.

    Headers past MAX_HEADER_BYTES get 431; a body past MAX_REQUEST_BYTES (declared,
    or counted as it streams in) gets 413, and the application behind sees the
    client gone instead of the rest of the body. (Heads past the HTTP server's own
    fence, TRANSPORT_MAX_HEAD_BYTES, are refused before they reach this code.)"""

    def __init__(self, app: ASGIApp, log: ActionLog) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        refusal = refused_head(scope.get("headers", []))
        if refusal is not None:
            await self._refuse(scope, receive, send, *refusal, started)
            return
        seen = 0
        over = False
        responded = False

        async def counted_receive() -> Message:
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limits.MAX_REQUEST_BYTES:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal responded
            if over:
                return  # the 413 below is the only answer
            responded = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not over:
                raise
        if over and not responded:
            await self._refuse(scope, None, send, 413, too_large_request(), started)

    async def _refuse(
        self,
        scope: Scope,
        receive: Receive | None,
        send: Send,
        status: int,
        reason: str,
        started: float,
    ) -> None:
        await log_request_refusal(self.log, str(scope.get("path", "?")), reason, started)
        from starlette.responses import JSONResponse

        response = JSONResponse({"error": reason}, status_code=status)
        response.headers["Connection"] = "close"

        async def nothing() -> Message:
            return {"type": "http.disconnect"}

        await response(scope, receive or nothing, send)


async def log_request_refusal(log: ActionLog, path: str, reason: str, started: float) -> None:
    """The line of a request refused for its shape (head, size, path or method) before
    any handler ran: the tool is the path it asked for."""
    path = path[:100]
    await log.write(
        session="?",
        tool=f"mcp:{path}" if path.startswith(MCP_PATH) else path,
        decision="refuse",
        reason=reason,
        category="request",
        arguments={},
        duration_ms=(time.perf_counter() - started) * 1000,
    )
