"""What the bridge's tests share: a raw upstream server on loopback (the outside
world, recording every request byte for byte), its replies, an in-process guard with
its own log, and every kind of request the step can make on the bridge. A helper,
not a test module, so no test file imports another."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Callable
from contextvars import Context
from pathlib import Path
from typing import Any

from sandbox.contracts.wire import MAX_REQUEST_BYTES, ActionLine
from sandbox.guard.actionlog import ActionLog
from sandbox.guard.bridge.routes import Guard
from sandbox.guard.limits import MAX_UPSTREAM_REPLY_BYTES
from tests.conftest import BRIDGE_TOKEN, guard_config
from tests.fakes.loopback import LoopbackServer

TOKEN = BRIDGE_TOKEN
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Upstream:
    """A raw HTTP/1.1 server: `answer(n, body)` decides, per request on a connection,
    the reply bytes (None: close the connection without a reply)."""

    def __init__(
        self, answer: Callable[[int, bytes], bytes | None], *, close_after_reply: bool = False
    ) -> None:
        self.answer = answer
        self.close_after_reply = close_after_reply  # without saying Connection: close
        self.requests: list[bytes] = []  # every request body, in arrival order
        self.connections = 0
        self.closed = 0
        self._lock = threading.Lock()
        self._server = LoopbackServer(self._serve)
        self.url = self._server.url

    def _serve(self, conn: socket.socket, number: int) -> None:
        with self._lock:
            self.connections += 1
        buffer = b""
        n = 0
        # A reset is the guard dropping a reply past its cap: the exchange is over.
        with conn, contextlib.suppress(ConnectionError):
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    buffer += chunk
                if b"\r\n\r\n" not in buffer:
                    break
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                body, buffer = buffer[:length], buffer[length:]
                with self._lock:
                    self.requests.append(body)
                n += 1
                reply = self.answer(n, body)
                if reply is None:
                    break  # a connection that dies after the request arrived
                conn.sendall(reply)
                if self.close_after_reply:
                    break
        with self._lock:
            self.closed += 1

    def close(self) -> None:
        self._server.close()


class TimerCountingLoop(asyncio.SelectorEventLoop):
    """asyncio's own loop, counting the timers armed on it (in `timers`, which the test
    sets to 0 first)."""

    timers = 0

    def call_at(  # type: ignore[override]  # the stub's signature is generic over *args
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: Context | None = None,
    ) -> asyncio.TimerHandle:
        TimerCountingLoop.timers += 1
        return super().call_at(when, callback, *args, context=context)


def ok(text: str = "done") -> bytes:
    payload = json.dumps({"text": text}).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)


def make_guard(tmp_path: Path, name: str, upstream: str | None) -> tuple[Guard, Path]:
    """A guard in this process with its own action log (`<name>.jsonl`), no fsync."""
    actions = tmp_path / f"{name}.jsonl"
    actions.touch()
    config = guard_config(actions, upstream=upstream)
    return Guard(config, ActionLog(str(actions), secrets=(TOKEN,), durability="group")), actions


def oversized_reply(framing: str) -> bytes:
    """A reply past limits.MAX_UPSTREAM_REPLY_BYTES: its length declared one byte over
    (`declared`, only the first MiB sent), or chunked with no length (`chunked`)."""
    cap = MAX_UPSTREAM_REPLY_BYTES
    piece = b"x" * (1024 * 1024)
    if framing == "declared":
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (cap + 1) + piece
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    chunks = cap // len(piece) + 1
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * chunks + b"0\r\n\r\n"


# (method, path, headers, body): every kind of request the step can make on the bridge.
# A header given as a list is sent once per value, in that order.
Request = tuple[str, str, dict[str, Any], bytes | Callable[[], AsyncIterator[bytes]]]


def call_body(tool: str, **arguments: Any) -> bytes:
    return json.dumps({"tool": tool, "arguments": arguments}).encode()


async def past_the_cap() -> AsyncIterator[bytes]:
    """A body with no declared length that grows past the cap as it streams in."""
    chunk = b" " * (1024 * 1024)
    for _ in range(MAX_REQUEST_BYTES // len(chunk) + 2):
        yield chunk


REQUESTS: list[Request] = [
    ("GET", "/v1/health", {}, b""),
    ("POST", "/v1/tools/call", AUTH, call_body("notify_user", text="hi")),  # stubbed
    ("POST", "/v1/tools/call", AUTH, call_body("generate_text_llm", prompt="p")),  # forwarded
    ("POST", "/v1/tools/call", AUTH, call_body("read_file", path="../../etc/passwd")),
    ("POST", "/v1/tools/call", AUTH, call_body("no_such_tool_anywhere")),
    ("POST", "/v1/tools/call", AUTH, b'{"tool": "notify_user", "session": "s-nope"}'),
    ("POST", "/v1/tools/call", {}, call_body("notify_user")),  # no token
    ("POST", "/v1/tools/call", {"Authorization": "Bearer wrong"}, call_body("notify_user")),
    ("POST", "/v1/tools/call", {"Authorization": TOKEN}, call_body("notify_user")),  # no scheme
    ("POST", "/v1/tools/call", AUTH, b""),
    ("POST", "/v1/tools/call", {"Authorization": ["Bearer wrong", AUTH["Authorization"]]}, b"{}"),
    ("POST", "/v1/tools/call", AUTH, b"{"),
    ("POST", "/v1/tools/call", AUTH, b"[]"),
    ("POST", "/v1/tools/call", AUTH, b'{"tool": 5}'),
    ("POST", "/v1/tools/call", AUTH, b'{"tool": "notify_user", "arguments": []}'),
    ("POST", "/v1/tools/call", AUTH, b"\xff\xfe"),
    ("POST", "/v1/tools/call", AUTH, b" " * (MAX_REQUEST_BYTES + 1)),  # declared, past
    ("POST", "/v1/tools/call", AUTH, past_the_cap),  # streamed, past
    ("POST", "/v1/tools/call", {**AUTH, "X-Pad": "x" * (17 * 1024)}, call_body("notify_user")),
    ("GET", "/v1/health", {"X-Pad": "x" * (17 * 1024)}, b""),
    ("POST", "/v1/sessions", AUTH, b"{}"),
    ("POST", "/v1/sessions", AUTH, b""),
    ("POST", "/v1/sessions", AUTH, b'{"parent": "root"}'),
    ("POST", "/v1/sessions", AUTH, b'{"parent": "s-unknown"}'),
    ("POST", "/v1/sessions", AUTH, b"{"),
    ("POST", "/v1/sessions", {}, b"{}"),
    ("POST", "/v1/sessions", AUTH, past_the_cap),
    ("GET", "/v1/nope", AUTH, b""),  # not a bridge path: the app behind answers
    ("GET", "/mcp", AUTH, b""),
    ("GET", "/mcp", {}, b""),
]


def normal_line(line: ActionLine) -> dict[str, Any]:
    """A line without what differs between two runs (time, ids, durations)."""
    fields = line.model_dump(exclude={"time", "duration_ms", "call_id"})
    fields["detail"] = {k: v for k, v in line.detail.items() if k != "child_session"}
    if str(fields.get("session", "")).startswith("s-"):
        fields["session"] = "s-*"
    if isinstance(fields["arguments"], dict) and fields["tool"] == "session.create":
        fields["arguments"] = {
            k: ("s-*" if str(v).startswith("s-") else v) for k, v in fields["arguments"].items()
        }
    return fields


def session_blind(body: bytes) -> bytes:
    """A reply with each minted session id replaced (they are random on each side)."""
    try:
        reply = json.loads(body)
    except ValueError:
        return body
    text = json.dumps(reply, sort_keys=True)
    for word in set(text.replace('"', " ").replace(".", " ").replace(",", " ").split()):
        if word.startswith("s-") and len(word) == 14:
            text = text.replace(word, "s-*")
    return text.encode()
