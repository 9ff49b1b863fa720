"""The bridge's one HTTP path: its three paths on raw ASGI, everything else to the
app behind.

Every tool call a step makes crosses this code, so it holds only what a call needs
(the route, the caps, the token, the body) before the guard's core
(`Guard.answer_call`); a framework's request objects, router and middleware are not
on this path. See bridge.spec.md.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from sandbox.guard import limits
from sandbox.guard.auth import BAD_TOKEN
from sandbox.guard.bridge.routes import Guard
from sandbox.guard.requestcaps import (
    json_bytes,
    log_request_refusal,
    refused_head,
    too_large_request,
)

TOOLS_CALL = "/v1/tools/call"
SESSIONS = "/v1/sessions"
HEALTH = "/v1/health"
_JSON = (b"content-type", b"application/json")
_CLOSE = (b"connection", b"close")


class BridgeFront:
    """ASGI app: `/v1/tools/call`, `/v1/sessions`, `/v1/health` here, the rest (MCP,
    lifespan, unknown paths) to `rest`, unchanged."""

    def __init__(self, guard: Guard, rest: ASGIApp) -> None:
        self.guard = guard
        self.rest = rest  # the framework app behind, inside the port's request caps
        self._methods: dict[str, frozenset[str]] = {
            TOOLS_CALL: frozenset({"POST"}),
            SESSIONS: frozenset({"POST"}),
            HEALTH: frozenset({"GET", "HEAD"}),
        }
        self._health: bytes | None = None

    def serves(self, path: str) -> bool:
        """Whether a request for `path` is this front's (a bridge path, or one with a
        trailing slash, refused here) rather than the app's behind."""
        if path in self._methods:
            return True
        bare = path.rstrip("/")
        return bare != path and bare in self._methods

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.serves(scope["path"]):
            await self.rest(scope, receive, send)
            return

        async def body() -> limits.CappedBody:
            return await limits.read_capped_body(receive, limits.MAX_REQUEST_BYTES)

        answer = await self.answer(scope["path"], scope["method"], scope["headers"], body)
        if answer is None:  # the client hung up before its body was in: no one to answer
            return
        await send(
            {"type": "http.response.start", "status": answer.status, "headers": answer.fields()}
        )
        await send({"type": "http.response.body", "body": answer.body})

    async def answer(
        self,
        path: str,
        method: str,
        headers: list[tuple[bytes, bytes]],
        read_body: Callable[[], Awaitable[limits.CappedBody]],
    ) -> Answer | None:
        """One request for a path this front `serves`: its answer (its line, if any,
        on disk first), or None when the client left before its body was in.

        `read_body` reads the body, up to the cap; it is called only once the head
        passed every check. The same answers whether the request came through ASGI
        (`__call__`) or straight from the HTTP protocol (`sandbox.guard.serve`)."""
        started = time.perf_counter()
        log = self.guard.log
        methods = self._methods.get(path)
        refusal = refused_head(headers)
        if refusal is not None:
            status, reason = refusal
            await log_request_refusal(log, path, reason, started)
            return Answer(status, json_bytes({"error": reason}), close=True)
        # The first one, as the framework's headers read it (a loop: a generator left
        # unfinished is closed with a GeneratorExit, each request).
        authorization = b""
        for name, value in headers:
            if name == b"authorization":
                authorization = value
                break
        if methods is None or method not in methods:
            extra: list[tuple[bytes, bytes]] = []
            if methods is None:
                status, reason = 404, f"no such path: {path[:100]}"
            else:
                allowed = ", ".join(sorted(methods))
                status, reason = 405, f"method {method[:20]} not allowed on {path} ({allowed})"
                extra = [(b"allow", allowed.encode())]
            await log_request_refusal(log, path, reason, started)
            return Answer(status, json_bytes({"error": reason}), extra=extra)
        if path == HEALTH:
            if self._health is None:
                self._health = self.guard.health_body()
            return Answer(200, self._health)
        if not self.guard.authorized(authorization):
            status, payload = await self.guard.refused(401, BAD_TOKEN, started)
            return Answer(status, payload)
        body, complete, gone = await read_body()
        if gone:
            return None
        if not complete:
            reason = too_large_request()
            await log_request_refusal(log, path, reason, started)
            return Answer(413, json_bytes({"error": reason}), close=True)
        handler: Callable[[bytes, float], Awaitable[tuple[int, bytes]]]
        handler = self.guard.answer_call if path == TOOLS_CALL else self.guard.answer_session
        status, payload = await handler(body, started)
        return Answer(status, payload)


@dataclass(frozen=True, slots=True)
class Answer:
    """A bridge path's answer: always a JSON body with its length; `close` ends the
    connection after it (a request the guard refused for its size or head)."""

    status: int
    body: bytes
    close: bool = False
    extra: list[tuple[bytes, bytes]] = field(default_factory=list)  # more header fields

    def fields(self) -> list[tuple[bytes, bytes]]:
        """Its header fields, in the order both servers write them (ASGI's and the
        guard's own protocol)."""
        fields = [(b"content-length", str(len(self.body)).encode()), _JSON]
        if self.close:
            fields.append(_CLOSE)
        return fields + self.extra

    def field_lines(self) -> bytes:
        """`fields` as the guard's own protocol writes them: `name: value` and CRLF
        each, names in lower case. An answer with no more fields than its length and
        type (every tool call's) is written in one step, without the list."""
        if not self.close and not self.extra:
            return _PLAIN_FIELDS % len(self.body)
        return b"".join(name.lower() + b": " + value + b"\r\n" for name, value in self.fields())


_PLAIN_FIELDS = b"content-length: %d\r\ncontent-type: application/json\r\n"
