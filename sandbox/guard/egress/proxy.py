"""The egress proxy: the step's listener, and one connection's requests from head to
answer (egress.spec.md says what it guarantees).

Each request is read (`request`), judged against the allow list, and either
denied (one line, the stub or an error reply) or forwarded: its start line is on
disk before its first byte leaves (`begin`), the reply is relayed (`relay`) and its
outcome line follows. A CONNECT opens a tunnel (`tunnel`) whose requests run
through this same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import h11

from sandbox.contracts.guardconfig import GuardConfig
from sandbox.contracts.guardparts import EgressEntry
from sandbox.contracts.recording import EMPTY_SHA256
from sandbox.guard.actionlog import ActionLog, LogFull, Started
from sandbox.guard.egress import http1, lines, relay, replayed, splice
from sandbox.guard.egress.aliases import HostAliases
from sandbox.guard.egress.connection import CHUNK, Client, Direct, linger, read_within
from sandbox.guard.egress.http1 import Denied
from sandbox.guard.egress.pool import Pool, Upstream, dial
from sandbox.guard.egress.request import (
    Incoming,
    Seen,
    body_facts,
    judge_read,
    judge_websocket,
    match,
    next_request,
    read_body,
    upgrade_asked,
)
from sandbox.guard.egress.tunnel import ESTABLISHED, TlsContexts
from sandbox.guard.recording import Reads, Tap

IDLE_TIMEOUT_S = 60.0  # a kept-alive client connection with no request in it
READ_TIMEOUT_S = 30.0  # a request head or body that stops arriving
MEMO_ENTRIES = 256  # allow-list answers remembered per proxy


@dataclass
class EgressProxy:
    config: GuardConfig
    log: ActionLog
    active_calls: Callable[[], list[str]] = field(default=lambda: [])
    # Connections with a request (or a tunnel) in progress; the guard exits at once on
    # SIGTERM only when this is 0. A kept-alive connection waiting idle is not counted.
    open_connections: int = 0
    # Added to every line's detail: whose proxy this is (an MCP server's, by name).
    label: dict[str, object] = field(default_factory=dict)
    _pool: Pool = field(default_factory=Pool, repr=False)
    _connections: int = field(default=0, repr=False)
    _aliases: HostAliases | None = field(default=None, repr=False)
    _entries: dict[tuple[str, int, bool], EgressEntry | None] = field(
        default_factory=dict, repr=False
    )
    # The run's recording (and the one it replays); None: this proxy records nothing
    # (an MCP server's own proxy: its answers are recorded as the server's results).
    reads: Reads | None = field(default=None, repr=False)
    tls: TlsContexts = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.tls = TlsContexts(self.config)

    @property
    def upstream_reuses(self) -> int:
        """How many requests went out on a kept-alive upstream connection."""
        return self._pool.reuses

    def close(self) -> None:
        """Close the idle upstream connections (the proxy is stopping)."""
        self._pool.close()

    # -- one client connection -------------------------------------------------

    async def handle(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direct: Direct | None = None,
        tunnel: tuple[str, int, EgressEntry] | None = None,
    ) -> None:
        """Serve one connection of the step: through the proxy, or `direct` (redirected
        by the firewall; `tunnel`: its TLS, terminated already, to that host)."""
        self._connections += 1
        client = Client(reader, writer, self._connections)
        client.direct, client.tls = direct, tunnel is not None
        self.open_connections += 1
        try:
            keep = True
            while keep:
                keep = await self._one_request(client, tunnel=tunnel)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError):
            pass
        finally:
            self.open_connections -= 1
            try:
                if client.denied:
                    await linger(client)
                writer.close()
                # A plain TCP transport with nothing queued (every write was drained)
                # is closed by `close` itself, the socket's release only left to the
                # loop's next turn: waiting for it would cost the connection one more
                # wake-up of this task. TLS says goodbye first, and a lingering close
                # still reads: both are waited for.
                if client.tls or client.denied or writer.transport.get_write_buffer_size():
                    await writer.wait_closed()
            except Exception:  # the connection is gone either way
                pass

    async def _one_request(
        self, client: Client, tunnel: tuple[str, int, EgressEntry] | None
    ) -> bool:
        """Read, judge and answer one request; whether the connection carries another."""
        started = time.perf_counter()
        seen = Seen(tls="inspected" if tunnel else "", connection=client.number)
        if client.direct is not None:
            direct = client.direct
            seen.via, seen.destination = "direct", f"{direct.address}:{direct.port}"
        incoming: Incoming | None = None
        try:
            incoming = await next_request(client, self._fill)
            if incoming is None:
                return False
            seen.method = incoming.method.decode("ascii")
            if tunnel is not None:
                return await self._inside_tunnel(client, incoming, tunnel, seen, started)
            if incoming.method == b"CONNECT":
                return await self._connect(client, incoming, seen, started)
            return await self._plain(client, incoming, seen, started)
        except Denied as denied:
            await self._deny(client, incoming, seen, denied, started)
            return False
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError):
            return False
        except Exception as exc:  # fail closed, and say why
            failure = Denied(502, f"proxy error: {type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                await self._deny(client, incoming, seen, failure, started)
            return False

    async def fill(self, client: Client, *, idle: bool) -> bytes:
        return await self._fill(client, idle=idle)

    async def begin_line(
        self, seen: Seen, reason: str, *, category: str, extra_detail: dict[str, Any]
    ) -> Started:
        return await self._begin(seen, reason, category=category, extra_detail=extra_detail)

    def facts(self, seen: Seen, *, status: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
        return self._facts(seen, status=status)

    async def _fill(self, client: Client, *, idle: bool) -> bytes:
        """The client's next bytes (b"" at its end). `idle`: between requests, when the
        connection does not count as busy and may wait longer."""
        if idle:
            self.open_connections -= 1
        try:
            return await read_within(
                client.reader, CHUNK, IDLE_TIMEOUT_S if idle else READ_TIMEOUT_S
            )
        finally:
            if idle:
                self.open_connections += 1

    # -- judging ------------------------------------------------------------------

    async def _plain(self, client: Client, incoming: Incoming, seen: Seen, started: float) -> bool:
        request = incoming.request
        seen.url = request.target.decode("ascii")
        direct = client.direct
        target = direct.target(request.target) if direct else http1.absolute_target(request.target)
        seen.url, seen.host = target.url("http"), target.host
        if not self._noted_aliases(seen):
            await self._note_aliases(seen)
        http1.check_host(request, incoming.fields, target.host, target.port, 80)
        websocket = upgrade_asked(incoming, seen)
        entry = self._entry(target.host, target.port, tunnel=False)
        if entry is None:
            reason = f"{target.host}:{target.port} is not on the egress allow list"
            raise Denied(403, reason, stub=True)
        body, served = await self._judge(client, incoming, entry, target, seen, websocket, started)
        if isinstance(served, bool):
            return served
        upstream = self._pool.take(target.host, target.port)
        if upstream is None:
            upstream = await self._dial(target.host, target.port)
        return await self._forward(
            client, incoming, upstream, target, entry, seen, started, body, live=served
        )

    async def _connect(
        self, client: Client, incoming: Incoming, seen: Seen, started: float
    ) -> bool:
        request = incoming.request
        seen.url = request.target.decode("ascii")
        host, port = http1.connect_target(request.target)
        seen.host = host
        if not self._noted_aliases(seen):
            await self._note_aliases(seen)
        http1.check_host(request, incoming.fields, host, port, port)
        if incoming.fields.get(b"content-length") or incoming.fields.get(b"transfer-encoding"):
            raise Denied(400, "a CONNECT carries no body")
        entry = self._entry(host, port, tunnel=True)
        if entry is None:
            raise Denied(403, f"CONNECT to {host}:{port} is not on the egress allow list")
        async for _ in read_body(client, incoming, self._fill):
            pass
        if not self.config.egress.inspects(entry):
            await self.blind_tunnel(client, host, port, entry, seen, started)
            return False
        if client.buffer:
            raise Denied(400, "bytes arrived before the tunnel was open")
        context = self.tls.for_step(host)
        await client.write(ESTABLISHED)
        client.replying = True
        try:
            await client.writer.start_tls(context)
        except (ssl.SSLError, ConnectionError, TimeoutError) as exc:
            seen.tls = "inspected"
            reason = f"the step's TLS handshake with the proxy failed: {exc}"
            await self.record(seen, "refuse", reason, started, status=None)
            return False
        client.tls, client.replying = True, False
        keep = True
        while keep:
            keep = await self._one_request(client, tunnel=(host, port, entry))
        return False

    async def _inside_tunnel(
        self,
        client: Client,
        incoming: Incoming,
        tunnel: tuple[str, int, EgressEntry],
        seen: Seen,
        started: float,
    ) -> bool:
        host, port, entry = tunnel
        request = incoming.request
        seen.host = host
        if not self._noted_aliases(seen):
            await self._note_aliases(seen)
        raw = request.target.decode("ascii")
        # Until the target is judged the line shows it as sent, never glued to the host.
        seen.url = http1.Target(host, port, raw).url("https") if raw.startswith("/") else raw
        target = http1.tunnel_target(request.target, host, port)
        seen.url = target.url("https")
        http1.check_host(request, incoming.fields, host, port, 443)
        websocket = upgrade_asked(incoming, seen)
        body, served = await self._judge(client, incoming, entry, target, seen, websocket, started)
        if isinstance(served, bool):
            return served
        upstream = await self._dial(host, port, tls=self.tls.to_hosts(), server_hostname=host)
        return await self._forward(
            client, incoming, upstream, target, entry, seen, started, body, live=served
        )

    async def _judge(
        self,
        client: Client,
        incoming: Incoming,
        entry: EgressEntry,
        target: http1.Target,
        seen: Seen,
        websocket: bool,
        started: float,
    ) -> tuple[bool, bool | replayed.GoLive | None]:
        """Judge an allow-listed request (raises when it may not pass), then, in a replay,
        answer it from the recording. Whether its body is forwarded (a model call or a git
        fetch), and: the replayed answer's keep-alive (bool), a miss that goes live
        (`GoLive`), or None (no replay: forward it)."""
        body = False
        if websocket:
            judge_websocket(incoming, entry, seen)
        else:
            body = judge_read(incoming, entry, target.origin, seen)
        if self.reads is None or self.reads.replay is None or websocket:
            return body, None
        served = await replayed.answer(
            self, self.reads, client, incoming, seen, entry.model, started, sends_body=body
        )
        return body, served

    # -- forwarding ---------------------------------------------------------------

    async def _forward(
        self,
        client: Client,
        incoming: Incoming,
        upstream: Upstream,
        target: http1.Target,
        entry: EgressEntry,
        seen: Seen,
        started: float,
        body: bool,
        *,
        live: replayed.GoLive | None = None,
    ) -> bool:
        """Send the rebuilt request (`body`: with its body, a model call or a git fetch),
        then relay the reply; whether the client's connection carries another request.
        `upstream` goes back to the pool (or is closed) either way. `live`: a replay's miss
        that goes out (its body read already). The reply of a read is recorded (`Tap`) as
        it is relayed."""
        given_back = False
        tap: Tap | None = None
        try:
            request = incoming.request
            default_port = 443 if seen.tls else 80
            framing = (b"content-length", b"transfer-encoding") if body else ()
            headers = [
                (b"Host", target.authority(default_port).encode("ascii")),
                *http1.forward_headers(request, keep=framing),
            ]
            if seen.websocket:
                headers += [(b"Connection", b"Upgrade"), (b"Upgrade", b"websocket")]
            elif upstream.sock is None:  # TLS to the host: one connection per request
                headers.append((b"Connection", b"close"))
            sent = relay.Sent(request.method, target.origin.encode("ascii"), headers)
            outgoing, head = relay.request_head(sent)
            kind = (
                "WebSocket"
                if seen.websocket
                else "model call"
                if entry.model
                else "git fetch (git-upload-pack)"
                if seen.git
                else "read"
            )
            where = " (inspected inside TLS)" if seen.tls else ""
            # Plain TCP: whoever writes the line (the loop, or the log's writer thread)
            # sends the head the moment it is written, before any sync; the reply is
            # relayed only once `begin` returns (per-call: the line on disk).
            early = [0]

            def send_head() -> None:
                seen.forwarded = True  # a sync failing after this: an error, not a refusal
                early[0] = upstream.send_now(head)

            head_sha256, shown = lines.head_facts(head)
            logged = await self._begin(
                seen,
                f"allow-listed {kind}{where}",
                category="model" if entry.model else "egress",
                extra_detail={
                    "resolved": upstream.address,
                    "forwarded_sha256": head_sha256,
                    **({"upstream_reused": True} if upstream.reused else {}),
                },
                extra_arguments={"forwarded_head": shown},
                then=send_head if upstream.sock is not None else None,
            )
            seen.forwarded = True
            outcome: dict[str, Any] = {"websocket": True} if seen.websocket else {}
            try:
                if logged.then_error is not None:
                    raise logged.then_error
                await upstream.send(head[early[0] :])
                if seen.websocket:
                    await relay.relay_upgrade(client, upstream, sent, outcome)
                    return False
                expects = b"100-continue" in incoming.fields.get(b"expect", b"")
                if body and expects and live is None:  # a replay's miss had its 100
                    await client.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                body_hash = None
                if outgoing is not None:  # h11 frames the body (none for a read)
                    body_hash = hashlib.sha256()
                    chunks = (
                        replayed.chunks(live.body)
                        if live is not None and live.body is not None
                        else read_body(client, incoming, self._fill)
                    )
                    async for chunk in chunks:
                        body_hash.update(chunk)
                        await upstream.send(outgoing.send(h11.Data(data=chunk)) or b"")
                    await upstream.send(outgoing.send(h11.EndOfMessage()) or b"")
                if self.reads is not None:
                    digest = body_hash.hexdigest() if body_hash is not None else EMPTY_SHA256
                    key = replayed.egress_key(seen, digest)
                    if live is not None:
                        self.reads.recorder.note_miss(key, "egress", replayed.what(seen))
                        outcome.update(replay="live", replay_key=key)
                    mark = "live" if live is not None else ""
                    tap = self.reads.recorder.tap(key, "egress", replayed.what(seen), replay=mark)
                    client.tap = tap
                keep = await relay.relay_reply(client, upstream, outgoing, sent, request, outcome)
                # free for the next request at once, while this one's outcome is written
                given_back = True
                self._pool.give_back(target.host, target.port, upstream)
                return keep
            except BaseException as exc:  # a cancelled exchange (the guard stopping) too
                outcome["error"] = lines.failure(exc)
                upstream.reusable = False
                raise
            finally:
                # the reply has gone out: the next request on this connection need not
                # wait for this line's sync (it is on disk before that request's start)
                ok = "error" not in outcome and not outcome.get("reply_cut")
                if tap is not None:
                    client.tap = None
                    tap.close(complete=ok)
                self.log.outcome_queued(logged, ok=ok, detail=outcome)
        finally:
            if not given_back:
                self._pool.give_back(target.host, target.port, upstream)

    async def blind_tunnel(
        self, client: Client, host: str, port: int, entry: EgressEntry, seen: Seen, started: float
    ) -> None:
        """An opted-out host: the tunnel is relayed unopened and the line says so."""
        upstream = await self._dial(host, port)
        seen.tls = "method not seen"
        try:
            logged = await self._begin(
                seen,
                "allow-listed CONNECT to a host with inspect = false; "
                "the method inside TLS was not seen",
                category="model" if entry.model else "egress",
                extra_detail={"resolved": upstream.address},
            )
            seen.forwarded = True
            outcome: dict[str, Any] = {}
            try:
                if client.direct is None:  # a redirected connection asked for no tunnel
                    await client.write(ESTABLISHED)
                await relay.relay_both_ways(client, upstream)
            except BaseException as exc:  # a cancelled tunnel (the guard stopping) too
                outcome["error"] = lines.failure(exc)
                raise
            finally:
                await self.log.outcome(logged, ok="error" not in outcome, detail=outcome)
        finally:
            upstream.close()

    # -- denial and records -------------------------------------------------------

    async def _deny(
        self,
        client: Client,
        incoming: Incoming | None,
        seen: Seen,
        denied: Denied,
        started: float,
    ) -> None:
        """Record the denial, then answer it (stub reply or error) and close."""
        if seen.forwarded:
            # The request went out: its start line says so and its outcome line (written
            # where it was forwarded) says how it failed; that is not a second decision.
            # The step gets an error if no reply has started.
            if not client.replying:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await client.write(lines.error_reply(denied, seen))
            return
        body = await body_facts(client, incoming, self._fill) if denied.stub else {}
        if incoming is None and client.buffer:
            body["head_bytes"] = len(client.buffer)
            body["head_sha256"] = lines.sha(bytes(client.buffer))
            first = bytes(client.buffer[:200]).split(b"\n", 1)[0]
            body["first_line"] = first.decode("latin-1")
        decision = "stub" if denied.stub else "refuse"
        if not denied.unlogged:
            await self.record(
                seen, decision, denied.reason, started, status=denied.status, body=body
            )
        if client.replying:
            return  # a reply is under way: ending the connection is the only honest answer
        with contextlib.suppress(ConnectionError, RuntimeError):
            await client.write(lines.error_reply(denied, seen))
        client.denied = True

    async def record(
        self,
        seen: Seen,
        decision: str,
        reason: str,
        started: float,
        *,
        status: int | None,
        category: str = "egress",
        body: dict[str, Any] | None = None,
    ) -> None:
        """The one line of a request that was not forwarded (a denial)."""
        arguments, detail = self._facts(seen, status=status, body=body)
        await self.log.write(
            session="egress",
            tool="http",
            decision=decision,
            reason=reason,
            category=category,
            arguments=arguments,
            duration_ms=(time.perf_counter() - started) * 1000,
            detail=detail,
        )

    async def _begin(
        self,
        seen: Seen,
        reason: str,
        *,
        category: str,
        extra_detail: dict[str, Any],
        extra_arguments: dict[str, Any] | None = None,
        then: Callable[[], object] | None = None,
    ) -> Started:
        """The start line of a request about to be forwarded: written before its first
        byte leaves (`then`: that first byte, sent right after the line's write), on
        disk (per-call) before this returns. With the log full, or a log that cannot be
        written, the request is refused instead (Denied): nothing was sent. A sync that
        failed after the head went fails the request (Denied, as sent but failed): its
        reply is never relayed, the connection is not reused, and the failed log takes
        no line more."""
        arguments, detail = self._facts(
            seen, status=None, extra_detail=extra_detail, extra_arguments=extra_arguments
        )
        try:
            return await self.log.begin(
                session="egress",
                tool="http",
                decision="allow",
                reason=reason,
                category=category,
                arguments=arguments,
                detail=detail,
                then=then,
            )
        except LogFull as full:
            raise Denied(403, str(full), unlogged=True) from None
        except OSError as exc:  # the line is not on disk: nothing more may happen
            reason = f"the action log could not be written ({exc.strerror or exc})"
            raise Denied(502, reason, unlogged=True) from None

    async def _note_aliases(self, seen: Seen) -> None:
        """The allow-listed names of an address, or the addresses of a name, for the line."""
        if self._aliases is None:
            self._aliases = HostAliases(self.config.egress)
        seen.aliases = await self._aliases.detail(seen.host)

    def _noted_aliases(self, seen: Seen) -> bool:
        """`_note_aliases` when its answer is known already (no wait): whether it was."""
        if self._aliases is None:
            return False
        found = self._aliases.remembered(seen.host)
        if found is None:
            return False
        seen.aliases = found
        return True

    def _entry(self, host: str, port: int, *, tunnel: bool) -> EgressEntry | None:
        """`request.match` against this proxy's allow list (frozen with its config),
        remembered per host, port and kind (at most MEMO_ENTRIES: the step chooses the
        hosts it names)."""
        key = (host, port, tunnel)
        if key in self._entries:
            return self._entries[key]
        entry = match(self.config.egress, host, port, tunnel=tunnel)
        if len(self._entries) >= MEMO_ENTRIES:
            self._entries.clear()
        self._entries[key] = entry
        return entry

    def _facts(
        self,
        seen: Seen,
        *,
        status: int | None,
        body: dict[str, Any] | None = None,
        extra_detail: dict[str, Any] | None = None,
        extra_arguments: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Every egress line's arguments and detail (`lines.facts`)."""
        return lines.facts(
            seen,
            self.label,
            self.active_calls(),
            status=status,
            body=body,
            extra_detail=extra_detail,
            extra_arguments=extra_arguments,
        )

    async def _dial(self, host: str, port: int, **tls: Any) -> Upstream:
        """`pool.dial`, unless the action log is full: then nothing is dialled and the
        request is refused."""
        try:
            self.log.check_room()
        except LogFull as full:
            raise Denied(403, str(full)) from None
        return await dial(host, port, **tls)


async def listen(proxy: EgressProxy, listener: socket.socket) -> asyncio.Server:
    """Serve `proxy` on a socket that already listens: the step's port on loopback, or
    the unix socket an MCP server's relay reaches."""
    limit = http1.MAX_HEAD_BYTES
    if listener.family == socket.AF_UNIX:
        return await asyncio.start_unix_server(proxy.handle, sock=listener, limit=limit)
    return await asyncio.start_server(proxy.handle, sock=listener, limit=limit)


@contextlib.asynccontextmanager
async def running(
    config: GuardConfig,
    log: ActionLog,
    active_calls: Callable[[], list[str]] | None = None,
    listener: socket.socket | None = None,
) -> AsyncIterator[EgressProxy]:
    """Serve the proxy on loopback for the guard's lifetime (on `listener` when given)."""
    proxy = EgressProxy(config, log, active_calls or (lambda: []))
    if listener is not None:
        server = await listen(proxy, listener)
    else:
        server = await asyncio.start_server(
            proxy.handle, "127.0.0.1", config.egress_port, limit=http1.MAX_HEAD_BYTES
        )
    for sock in server.sockets:  # before the first connection is accepted
        splice.unpaced(sock)
    try:
        yield proxy
    finally:
        server.close()
        proxy.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


@contextlib.asynccontextmanager
async def serving_mcp_servers(
    config: GuardConfig, log: ActionLog, listeners: dict[str, socket.socket]
) -> AsyncIterator[None]:
    """Each stdio MCP server's own proxy on its socket: this same code with that
    server's allow list, every line naming the server (`detail.mcp_server`)."""
    servers = {server.name: server for server in config.mcp_servers}
    async with contextlib.AsyncExitStack() as stack:
        for name, listener in listeners.items():
            own = config.model_copy(update={"egress": servers[name].own_egress()})
            proxy = EgressProxy(own, log, label={"mcp_server": name})
            unix_server = await listen(proxy, listener)
            stack.callback(proxy.close)
            stack.callback(unix_server.close)
        yield
