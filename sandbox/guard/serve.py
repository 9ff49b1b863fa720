"""The guard's web server: uvicorn on the bridge port, beside the network side
(`sandbox.guard.network`) that `sandbox.guard.startup` serves before importing this.

One process, one event loop (uvloop), one HTTP parser for the bridge and MCP port
(httptools, llhttp: strict by default, as h11 was). The parser holds whatever head
it is given, so the head cap it lacks is kept here (`HeadCappedProtocol`). The
bridge's own paths are answered from that protocol without ASGI (`BridgeCycle`);
MCP and everything else go through uvicorn's cycle to the app.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import sys
from collections.abc import Coroutine
from types import FrameType
from typing import cast

import uvicorn
from uvicorn._types import ASGI3Application, ASGISendEvent
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from sandbox.contracts.guardconfig import READY_MARK
from sandbox.guard.app import build_app
from sandbox.guard.bridge.front import Answer, BridgeFront
from sandbox.guard.bridge.routes import Guard
from sandbox.guard.limits import (
    MAX_REQUEST_BYTES,
    TRANSPORT_MAX_HEAD_BYTES,
    CappedBody,
    mib,
    read_capped,
)
from sandbox.guard.requestcaps import json_bytes

# How long a thread that wants the interpreter lock waits before the running one must
# let go of it (Python's default: 5 ms), once the guard serves. The action log's threads
# hand lines between the loop and themselves (the writer while a group-commit sync runs,
# the syncer finishing its sync): with the loop busy serving other clients, each such
# hand-off waited up to the whole default, a forwarded call's tail. The threads mostly
# sleep, so a shorter interval costs nothing when nothing contends. Start-up keeps the
# default (nothing there is on a request's path).
SWITCH_INTERVAL_S = 0.0005

HEAD_TOO_LARGE = f"request head larger than {mib(TRANSPORT_MAX_HEAD_BYTES)} (the guard's cap)"


def _head_refusal() -> bytes:
    body = json_bytes({"error": HEAD_TOO_LARGE})
    return (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"connection: close\r\n\r\n" + body
    )


class _HeldHead:
    """The cycle's transport while a reply's head waits for its body: the first write
    after the head goes out with it, as one write; everything else passes through."""

    __slots__ = ("head", "real")

    def __init__(self, real: asyncio.Transport) -> None:
        self.real = real
        self.head: list[bytes] = []

    def write(self, data: bytes) -> None:
        if self.head:
            self.head.append(data)
            data = b"".join(self.head)
            self.head = []
        self.real.write(data)

    def hold(self, data: bytes) -> None:
        self.head.append(data)

    def close(self) -> None:
        if self.head:  # a held head still goes out, before the close
            self.write(b"")
        self.real.close()

    def is_closing(self) -> bool:
        return self.real.is_closing()


class OneWriteCycle(RequestResponseCycle):
    """uvicorn's request cycle, with a reply's head and its first body bytes in one
    write(2) (one segment to the client) instead of two.

    The head is held only when the reply declares a Content-Length (the client can
    use nothing of it before the body), is not to a HEAD (which gets no body write)
    and no 100 Continue may still be due; a chunked reply (an MCP event stream) has
    its head written at once, as before.
    The order of writes and of the close is uvicorn's: the held head goes out with
    the next write, or before a close."""

    async def send(self, message: ASGISendEvent) -> None:
        if (
            self.response_started
            or self.waiting_for_100_continue
            or self.flow.write_paused
            or self.scope["method"] == "HEAD"  # uvicorn writes no body for it
        ):
            await super().send(message)
            return
        real = self.transport
        held = _HeldHead(real)
        writes: list[bytes] = []
        self.transport = _Recorder(writes)  # type: ignore[assignment]
        try:
            await super().send(message)  # the start: no await inside (the flow is not paused)
        finally:
            self.transport = real
        if not writes:
            return
        if self.chunked_encoding is False and self.response_started:
            held.hold(b"".join(writes))
            self.transport = held
        else:
            real.write(b"".join(writes))


class _Recorder:
    """Takes the bytes uvicorn writes for a reply's head (nothing else happens then)."""

    __slots__ = ("writes",)

    def __init__(self, writes: list[bytes]) -> None:
        self.writes = writes

    def write(self, data: bytes) -> None:
        self.writes.append(data)


class BridgeCycle(RequestResponseCycle):
    """A request for one of the bridge's own paths (`BridgeFront.serves`), answered
    from the protocol without ASGI: the front's `answer` reads the body from this
    cycle as uvicorn's `receive` would (the same flow control, the same 100 Continue,
    up to the same cap) and its answer is one write of head and body, with the
    fields, order and close uvicorn's `send` gives the same reply through the front's
    ASGI path. No message dicts, no header re-validation, no app call stack: every
    tool call a step makes comes this way. Everything else about the connection
    (keep-alive, pipelining, shutdown, the keep-alive timer) is uvicorn's, driven
    through the cycle's state as its own `send` drives it."""

    async def run_bridge(self, front: BridgeFront) -> None:
        """`run_asgi`'s counterpart: an exception is a 500 (or a close once the reply
        started), logged as uvicorn logs it."""
        try:
            scope = self.scope
            headers = cast(list[tuple[bytes, bytes]], scope["headers"])  # the protocol's list
            answer = await front.answer(scope["path"], scope["method"], headers, self._read_body)
            if answer is not None:
                await self._reply(answer)
        except BaseException as exc:
            self.logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self.send_500_response()
            else:
                self.transport.close()
        finally:
            self.on_response = lambda: None

    def _read_body(self) -> Coroutine[object, None, CappedBody]:
        """The request's body, never more than MAX_REQUEST_BYTES (and one read) held:
        `limits.read_capped` over what uvicorn's `receive` reads, without the messages
        (its coroutine itself: no coroutine of this method's own around it)."""
        return read_capped(self._next_chunk, MAX_REQUEST_BYTES)

    async def _next_chunk(self) -> tuple[bytes, bool] | None:
        """uvicorn's `receive` without its message: the next bytes of the body and
        whether more follow; None once the client is gone (or the reply is complete)."""
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            event = self.message_event
            if not event.is_set():  # else `wait` would return at once: no coroutine for it
                await event.wait()
            event.clear()
        if self.disconnected or self.response_complete:
            return None
        chunk = bytes(self.body)
        self.body = bytearray()
        return chunk, self.more_body

    async def _reply(self, answer: Answer) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        self.response_started = True
        self.waiting_for_100_continue = False
        if answer.close:
            self.keep_alive = False
        parts = [STATUS_LINE[answer.status], _default_lines(self.default_headers)]
        parts.append(answer.field_lines())
        if not self.keep_alive and not answer.close:
            parts.append(_CLOSE_FIELD)
        parts.append(b"\r\n")
        if self.scope["method"] != "HEAD":  # a HEAD's reply has the length, not the body
            parts.append(answer.body)
        self.transport.write(b"".join(parts))
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()


_CLOSE_FIELD = b"connection: close\r\n"
# The server's default header fields as lines, for the list they were made from: uvicorn
# makes a new list when its date changes (once a second), so each list is written out
# once rather than once per reply. The list is held here, so its identity stays its own.
_defaults: tuple[list[tuple[bytes, bytes]] | None, bytes] = (None, b"")


def _default_lines(defaults: list[tuple[bytes, bytes]]) -> bytes:
    global _defaults
    seen, lines = _defaults
    if seen is not defaults:
        lines = b"".join(name.lower() + b": " + value + b"\r\n" for name, value in defaults)
        _defaults = (defaults, lines)
    return lines


class HeadCappedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a cap on a request head's size.

    llhttp keeps no buffer, but httptools gathers each header name and value whole
    and uvicorn keeps the URL and the header list: a head that never ends would grow
    without bound (h11 had `max_incomplete_event_size`; this is its stand-in). While
    a head is incomplete, its bytes are fed to the parser at most up to
    TRANSPORT_MAX_HEAD_BYTES; a head not complete by then is answered 431 (a bare
    JSON error, no line: the head never reached the guard's code) and the
    connection closed. Bytes after a head (its body, the next request of a pipeline)
    go in pieces of at most the cap, so a head that begins inside such a piece is
    held at most 2x the cap before it is refused."""

    _in_head = True  # a new connection waits for a head
    _head_bytes = 0
    # The keep-alive timer: uvicorn arms one after every reply and cancels it at the
    # next request's first bytes (a timer made and dropped per request). Here a
    # connection keeps one armed while it is kept alive; when it fires it closes the
    # connection if it has been idle since a reply for `timeout_keep_alive`, or is
    # set again for what is left of that time. Idle means what it meant to uvicorn:
    # from a reply's end (none pipelined behind it) to the next bytes received.
    _idle_since: float | None = None  # loop time of the reply that left it idle
    _idle_timer: asyncio.TimerHandle | None = None
    _front: BridgeFront | None = None  # `_bridge_front`, once asked
    _front_known = False

    def on_message_begin(self) -> None:
        self._in_head = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()
        cycle = self.cycle
        if type(cycle) is RequestResponseCycle:
            # made just now by uvicorn, not yet run: the same cycle, one write per reply
            cycle.__class__ = OneWriteCycle

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        """A bridge path's request runs as a `BridgeCycle` (no ASGI); any other, or
        one uvicorn sends elsewhere (over its concurrency limit), as uvicorn runs it."""
        if not self._front_known:
            self._front, self._front_known = self._bridge_front(), True
        front = self._front
        if (
            front is not None
            and app is self.app
            and type(cycle) in (RequestResponseCycle, OneWriteCycle)
            and front.serves(cycle.scope["path"])
        ):
            cycle.__class__ = BridgeCycle
            task = self.loop.create_task(cycle.run_bridge(front))  # type: ignore[attr-defined]
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)
            return
        super()._start_asgi_task(cycle, app)

    def _bridge_front(self) -> BridgeFront | None:
        """The front whose paths run as a `BridgeCycle` on this connection, or None
        (another app, an access log, fresh context variables per request: uvicorn's
        own cycle then). Fixed by the config, so asked once per connection."""
        front = self.config.app
        if (
            isinstance(front, BridgeFront)
            and not self.access_log
            and not self.config.reset_contextvars
        ):
            return front
        return None

    def on_message_complete(self) -> None:
        self._in_head = True  # a kept-alive connection's next bytes are the next head
        super().on_message_complete()

    def _unset_keepalive_if_required(self) -> None:
        """Bytes came (or the connection ends): not idle; the timer stays armed."""
        self._idle_since = None

    def on_response_complete(self) -> None:
        """uvicorn's, with the keep-alive timer kept rather than made per request."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._idle_since = None
        self.flow.resume_reading()
        if self.pipeline:  # a pipelined request is next: start it
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        loop = self.loop
        self._idle_since = now = loop.time()
        if self._idle_timer is None:
            self._idle_timer = loop.call_at(now + self.timeout_keep_alive, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        since = self._idle_since
        if since is None or self.transport.is_closing():
            return  # busy (the reply that ends it arms the timer again), or gone
        due = since + self.timeout_keep_alive
        if self.loop.time() >= due:
            self.timeout_keep_alive_handler()
        else:
            self._idle_timer = self.loop.call_at(due, self._idle_check)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def data_received(self, data: bytes) -> None:
        cap = TRANSPORT_MAX_HEAD_BYTES
        if self._in_head and self._head_bytes + len(data) <= cap:
            self._head_bytes += len(data)  # the usual case: one read, one whole head
            super().data_received(data)
            return
        view = memoryview(data)
        while view:
            if self._in_head:
                room = cap - self._head_bytes
                if room <= 0:
                    self._refuse_head()
                    return
                piece = view[:room]
                self._head_bytes += len(piece)
            else:
                piece = view[:cap]
            view = view[len(piece) :]
            super().data_received(piece)  # type: ignore[arg-type]  # the parser takes a buffer
            if self.parser is None or self.transport.is_closing():
                return

    def _refuse_head(self) -> None:
        self.logger.warning(HEAD_TOO_LARGE)
        self.transport.write(_head_refusal())
        self.transport.close()


class GuardServer(uvicorn.Server):
    """uvicorn, plus two things the runner waits on in every run.

    Ready: one line on stdout once the bridge, MCP proxy and egress proxy serve.
    Stop: SIGTERM to an idle guard (no request, bridge call or egress connection
    open) exits at once. uvicorn's graceful shutdown pauses at least 0.1 s, often
    0.2, with nothing to finish: every action line is written before its call is
    answered. A busy guard shuts down gracefully (uvicorn's own shutdown).
    """

    def __init__(self, config: uvicorn.Config, guard: Guard) -> None:
        super().__init__(config)
        self._guard = guard
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if not self.should_exit:
            # What start-up made (the web stack, the models, the config: some 90,000
            # objects) lives as long as the guard: out of the collector's sight, so a
            # full collection never scans it (one took 17-22 ms of the loop's time, a
            # kept-alive request's tail), and nothing is collected to make that so.
            gc.freeze()
            # Serving from here on: the action log's hand-offs wait on a shorter switch.
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            print(READY_MARK, flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between any two bytecodes; decide between two loop
        # callbacks instead, where no action line can be half made.
        if sig == signal.SIGTERM and self._loop is not None and not self.should_exit:
            self._loop.call_soon_threadsafe(self._exit_if_idle, sig)
            return
        super().handle_exit(sig, frame)

    def _exit_if_idle(self, sig: int) -> None:
        state = self.server_state
        if not state.connections and not state.tasks and self._guard.idle():
            self._guard.log.close()
            os._exit(0)
        super().handle_exit(sig, None)


async def serve_app(
    guard: Guard,
    *,
    bridge: socket.socket,
    mcp: dict[str, socket.socket] | None = None,
    mcp_egress: dict[str, socket.socket] | None = None,
) -> bool:
    """Serve the bridge and MCP port on the running loop until stopped; whether it
    started. The network side (`sandbox.guard.network`) is the caller's, already
    serving: `sandbox.guard.startup` runs it before this module is imported.

    `mcp` / `mcp_egress`: each stdio MCP server's socket and egress socket."""
    # The bridge's ways out, made before anything is served (their modules came in
    # with this one's, in `sandbox.guard.startup`'s thread).
    _ = (guard.upstream, guard.executor)
    app = build_app(guard, mcp_listeners=mcp or {}, mcp_egress_listeners=mcp_egress, network=False)
    server = GuardServer(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
            # httptools: the h11 parser's share per call, measured on the bridge
            # (README, Performance); the loop is uvloop (`sandbox.guard.startup`).
            http=HeadCappedProtocol,
            ws="none",  # no upgrade is served: an Upgrade request is an HTTP request
            # The step is the only client and sits on loopback, which uvicorn trusts for
            # X-Forwarded-* by default: no rewriting of the client address on its word.
            proxy_headers=False,
            server_header=False,  # one header less per reply; nothing reads it
        ),
        guard,
    )
    await server.serve(sockets=[bridge])
    return server.started
