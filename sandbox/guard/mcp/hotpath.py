"""The endpoint's hot path: a session's plain `tools/call`, `tools/list` and `ping`,
answered without the SDK's streamable-HTTP session machinery.

A second code path beside the SDK's transport, kept for speed (mcp.spec.md has the
measurement). Its answers come from the endpoint's own handlers and must equal the
SDK's byte for byte: tests/guard/mcp/test_hotpath.py sends every case through both."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import mcp_types as types
import pydantic_core
from mcp.server import Server
from mcp.server.streamable_http import CONTENT_TYPE_JSON
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types import methods as _methods
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import ValidationError
from starlette.types import Message, Receive, Scope, Send

from sandbox.guard import limits
from sandbox.guard.mcp.context import McpContext

# Open step-side sessions per server (the SDK answers 503 past it). Sessions have no
# idle expiry: one the step uses only through the hot path has no request in flight
# on the SDK's side and would expire under it.
MAX_SESSIONS = 100

_HOT_METHODS = frozenset({"tools/call", "tools/list", "ping"})
_HOT_PARAMS = {"tools/call": {"name", "arguments"}, "tools/list": {"cursor"}, "ping": set()}
_ENVELOPE_KEYS = {"jsonrpc", "id", "method", "params"}
_ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ListForward = Callable[[Any, types.PaginatedRequestParams], Awaitable[dict[str, Any]]]


class Answering(Protocol):
    """What the hot path needs of its endpoint: the SDK's session manager and server,
    and the handlers the SDK's path calls too."""

    name: str
    context: McpContext
    server: Server[Any]
    security: TransportSecuritySettings
    manager: StreamableHTTPSessionManager
    lists: dict[str, ListForward]

    async def call_tool(self, params: types.CallToolRequestParams) -> dict[str, Any]: ...


class _Fallback(Exception):
    """Not a request the hot path answers: the SDK's transport gets it whole."""


class HotPath:
    """The endpoint's front: the few requests a step repeats, answered without the
    SDK's session machinery; everything else goes to the SDK unchanged.

    Answered here: a POST whose body is exactly one plain JSON-RPC request
    (`tools/call` with only `name`/`arguments`, `tools/list` with at most a
    `cursor`, `ping` without params), in a session the SDK opened and whose
    `initialize` it answered with a result, on the handshake-era protocol version
    that session negotiated (`Mcp-Protocol-Version` equal to it), with the Host,
    Origin, Content-Type and Accept the SDK's transport would accept. The answer is
    built by the same handlers (`call_tool`, the list forwarders: the same
    policy, action-log lines and errors), shaped by the SDK's own result
    serializer for that version and dumped as the SDK's transport dumps it, so a
    client sees the same bytes either way.

    Everything else, bytes unchanged (a body already read is replayed): the
    opening `initialize`, notifications, responses, batches, DELETE, GET (SSE),
    any other method, odd or malformed bodies, an unknown or ended session, the
    2026-07-28 era. The SDK's answers to those, errors included, are its own. Its
    503 past `MAX_SESSIONS` is logged here."""

    def __init__(self, endpoint: Answering) -> None:
        self.endpoint = endpoint
        self.sdk: _ASGIApp = endpoint.manager.handle_request
        self.enabled = True  # tests turn it off to get the SDK's answer for the same call
        self._security = TransportSecurityMiddleware(endpoint.security)
        self._versions: dict[str, str] = {}  # session id -> the version it negotiated

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled or scope["type"] != "http" or scope["method"] != "POST":
            await self._to_sdk(scope, receive, send, opening=False)
            return
        headers: dict[bytes, bytes] = {}
        for key, value in scope["headers"]:
            headers.setdefault(key, value)  # a repeated header: the SDK reads the first too
        session = headers.get(b"mcp-session-id")
        version = self._ready(session, headers)
        if session is None or version is None:
            await self._to_sdk(scope, receive, send, opening=session is None)
            return
        body, complete, _ = await limits.read_capped_body(
            receive, self.endpoint.manager.max_request_body_size
        )
        try:
            if not complete:
                raise _Fallback
            answer = await self._answer(body, version)
        except _Fallback:
            await self._to_sdk(scope, _replay(body, complete, receive), send, opening=False)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-length", str(len(answer)).encode()),
                    (b"content-type", b"application/json"),
                    (b"mcp-session-id", session),
                ],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    def _ready(self, session: bytes | None, headers: dict[bytes, bytes]) -> str | None:
        """The session's negotiated version when this request may be answered here."""
        if session is None:
            return None
        sid = session.decode("latin-1")
        version = self._versions.get(sid)
        transport = self.endpoint.manager._server_instances.get(sid)
        if version is None or transport is None or transport.is_terminated:
            return None
        if headers.get(b"mcp-protocol-version", b"").decode("latin-1") != version:
            return None
        if sid in self.endpoint.manager._session_owners:
            return None  # a credential-bound session: the SDK checks its owner
        content_type = headers.get(b"content-type", b"").decode("latin-1").lower()
        if content_type.split(";")[0].strip() != CONTENT_TYPE_JSON:
            return None
        if not self._security._validate_host(_text(headers.get(b"host"))):
            return None
        if not self._security._validate_origin(_text(headers.get(b"origin"))):
            return None
        accept = [
            part.split(";")[0].strip().lower()
            for part in headers.get(b"accept", b"").decode("latin-1").split(",")
        ]
        if not any(kind in (CONTENT_TYPE_JSON, "application/*", "*/*") for kind in accept):
            return None
        return version

    async def _answer(self, body: bytes, version: str) -> bytes:
        """The JSON-RPC reply to one plain request, or _Fallback for anything else."""
        try:
            message = pydantic_core.from_json(body)  # the SDK's parser, the SDK's depth limit
        except ValueError:
            raise _Fallback from None
        if not isinstance(message, dict) or not message.keys() <= _ENVELOPE_KEYS:
            raise _Fallback
        method, request_id = message.get("method"), message.get("id")
        if message.get("jsonrpc") != "2.0" or method not in _HOT_METHODS:
            raise _Fallback
        if isinstance(request_id, bool) or not isinstance(request_id, int | str):
            raise _Fallback
        params = message.get("params", {})
        if not isinstance(params, dict) or not params.keys() <= _HOT_PARAMS[method]:
            raise _Fallback
        endpoint = self.endpoint
        try:
            if method == "tools/call":
                name, arguments = params.get("name"), params.get("arguments")
                if not isinstance(name, str) or not isinstance(arguments, dict | None):
                    raise _Fallback
                call = types.CallToolRequestParams(name=name, arguments=arguments)
                result: dict[str, Any] = await endpoint.call_tool(call)
            elif method == "tools/list":
                cursor = params.get("cursor")
                if not isinstance(cursor, str | None):
                    raise _Fallback
                page = types.PaginatedRequestParams(cursor=cursor)
                result = await endpoint.lists[method](None, page)
            else:
                result = {}
            hint = endpoint.server.cache_hints.get(method)
            if hint is not None:
                result = {"ttlMs": hint.ttl_ms, "cacheScope": hint.scope, **result}
            try:
                wire = _methods.serialize_server_result(method, version, dict(result))
            except ValidationError:
                raise MCPError(
                    code=types.INTERNAL_ERROR, message="Handler returned an invalid result"
                ) from None
            # The bytes `JSONRPCResponse(...).model_dump_json(by_alias=True,
            # exclude_unset=True)` gives (the tests compare them), without the model.
            return pydantic_core.to_json({"jsonrpc": "2.0", "id": request_id, "result": wire})
        except MCPError as exc:
            reply: types.JSONRPCMessage = types.JSONRPCError(
                jsonrpc="2.0", id=request_id, error=exc.error
            )
        except _Fallback:
            raise
        except Exception as exc:  # as the SDK's dispatcher answers a handler's crash
            error = types.ErrorData(code=0, message=str(exc))
            reply = types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)
        return reply.model_dump_json(by_alias=True, exclude_unset=True).encode()

    async def _to_sdk(self, scope: Scope, receive: Receive, send: Send, *, opening: bool) -> None:
        """The SDK's transport; an opening request's reply is watched: a result to
        `initialize` makes its session one the hot path serves, a 503 (the session
        cap) is logged."""
        if not opening:
            await self.sdk(scope, receive, send)
            return
        status = 0
        session: str | None = None
        body = bytearray()

        async def watch(message: Message) -> None:
            nonlocal status, session
            if message["type"] == "http.response.start":
                status = message["status"]
                for key, value in message.get("headers", []):
                    if key.lower() == b"mcp-session-id":
                        session = value.decode("latin-1")
            elif message["type"] == "http.response.body" and len(body) < 65536:
                body.extend(message.get("body", b""))
            await send(message)

        await self.sdk(scope, receive, watch)
        if status == 503:
            await self.endpoint.context.log_line(
                tool=f"mcp:{self.endpoint.name}",
                decision="refuse",
                reason=f"too many open MCP sessions (at most {MAX_SESSIONS} per server)",
                arguments={},
                started=time.perf_counter(),
                detail={"server": self.endpoint.name, "max_sessions": MAX_SESSIONS},
                category="request",
            )
        if status != 200 or session is None:
            return
        with contextlib.suppress(ValueError):
            result = json.loads(body).get("result")
            version = result.get("protocolVersion") if isinstance(result, dict) else None
            if isinstance(version, str) and version in HANDSHAKE_PROTOCOL_VERSIONS:
                self._versions[session] = version
        live = self.endpoint.manager._server_instances
        for gone in [sid for sid in self._versions if sid not in live]:
            del self._versions[gone]


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def _replay(body: bytes, complete: bool, receive: Receive) -> Receive:
    """`receive` as if nothing had been read from it yet."""
    pending = [{"type": "http.request", "body": body, "more_body": not complete}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay
