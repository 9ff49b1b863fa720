"""The bridge's front: its three paths on raw ASGI, everything else to the app behind.

Every tool call a step makes crosses this code, so it is kept to what a call needs:
one dict look-up for the route, the caps, the token, the body, then the guard's own
core (`Guard.answer_call`), which is the same code the framework routes behind run.
The framework's request and response objects, router and middleware cost more per
call than the rest of the guard's own work without the log's syncs, so they are not
on this path. Same caps (`CappedRequests`' head and body caps, with the same lines
and answers), same policy, lines and error shapes as the routes behind; two
differences, both fail closed and logged: a wrong method is a 405 with its line
(the framework answers it with none), and a bridge path with a trailing slash is a
404 with its line (the framework redirects it).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from sandbox.guard import caps
from sandbox.guard.bridge import (
    Guard,
    json_bytes,
    log_request_refusal,
    refused_head,
    too_large_request,
)
from sandbox.guard.gate import BAD_TOKEN

TOOLS_CALL = "/v1/tools/call"
SESSIONS = "/v1/sessions"
HEALTH = "/v1/health"
_JSON = (b"content-type", b"application/json")
_CLOSE = (b"connection", b"close")


class BridgeFront:
    """ASGI app: `/v1/tools/call`, `/v1/sessions`, `/v1/health` here, the rest (MCP,
    lifespan, unknown paths) to `rest`, unchanged."""

    def __init__(self, guard: Guard, rest: ASGIApp, *, framework: Starlette | None = None) -> None:
        self.guard = guard
        self.rest = rest  # the caps wrapper around the framework app
        # The framework app itself (its router, for code and tests that look routes up).
        self.framework = framework
        self._methods: dict[str, frozenset[str]] = {
            TOOLS_CALL: frozenset({"POST"}),
            SESSIONS: frozenset({"POST"}),
            HEALTH: frozenset({"GET", "HEAD"}),
        }
        self._health: bytes | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.rest(scope, receive, send)
            return
        path: str = scope["path"]
        methods = self._methods.get(path)
        if methods is None:
            bare = path.rstrip("/")
            if bare == path or bare not in self._methods:
                await self.rest(scope, receive, send)
                return
        await self._serve(scope, receive, send, path, methods)

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        path: str,
        methods: frozenset[str] | None,
    ) -> None:
        started = time.perf_counter()
        log = self.guard.log
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        refusal = refused_head(headers)
        if refusal is not None:
            status, reason = refusal
            await log_request_refusal(log, path, reason, started)
            await _answer(send, status, json_bytes({"error": reason}), close=True)
            return
        # The first one, as the framework's headers read it.
        authorization = next((v for k, v in headers if k == b"authorization"), b"")
        method: str = scope["method"]
        if methods is None or method not in methods:
            if methods is None:
                status, reason, extra = 404, f"no such path: {path[:100]}", []
            else:
                allowed = ", ".join(sorted(methods))
                status, reason = 405, f"method {method[:20]} not allowed on {path} ({allowed})"
                extra = [(b"allow", allowed.encode())]
            await log_request_refusal(log, path, reason, started)
            await _answer(send, status, json_bytes({"error": reason}), extra=extra)
            return
        if path == HEALTH:
            if self._health is None:
                self._health = self.guard.health_body()
            await _answer(send, 200, self._health)
            return
        handler: Callable[[bytes, float], Awaitable[tuple[int, bytes]]]
        if not self.guard.authorized(authorization):
            status, payload = await self.guard.refused(401, BAD_TOKEN, started)
            await _answer(send, status, payload)
            return
        body, complete, gone = await caps.read_capped_body(receive, caps.MAX_REQUEST_BYTES)
        if gone:  # the client hung up before its body was in: no one to answer
            return
        if not complete:
            reason = too_large_request()
            await log_request_refusal(log, path, reason, started)
            await _answer(send, 413, json_bytes({"error": reason}), close=True)
            return
        handler = self.guard.answer_call if path == TOOLS_CALL else self.guard.answer_session
        status, payload = await handler(body, started)
        await _answer(send, status, payload)


async def _answer(
    send: Send,
    status: int,
    body: bytes,
    *,
    close: bool = False,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-length", str(len(body)).encode()), _JSON]
    if close:
        headers.append(_CLOSE)
    if extra:
        headers += extra
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
