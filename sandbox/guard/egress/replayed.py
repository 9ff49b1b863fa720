"""An allowed egress request answered from the recording a replay serves from.

The key is the method, the absolute URL (https for an inspected tunnel) and the
request body's SHA-256 (`sandbox.contracts.recording.key_of`). A hit gets the
recorded reply bytes (head as the proxy rebuilt it, then the body) and no
upstream is dialled; a miss gets a `TEST MODE` replay-miss reply (503) and one
line, or with misses live goes out as any read does. A body is read whole to
hash it: past the per-answer cap it can only be a miss, answered with the stub.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from sandbox.contracts.recording import egress_key as recorded_egress_key
from sandbox.contracts.recording import miss_text
from sandbox.guard.egress.request import Incoming, Seen, read_body

if TYPE_CHECKING:
    from sandbox.guard.actionlog import ActionLog, Started
    from sandbox.guard.egress.connection import Client
    from sandbox.guard.recording import Reads


class Proxy(Protocol):
    """What a replayed answer needs of the proxy that judged its request (the proxy
    itself; named here so this module does not import it)."""

    log: ActionLog

    async def fill(self, client: Client, *, idle: bool) -> bytes: ...

    async def begin_line(
        self, seen: Seen, reason: str, *, category: str, extra_detail: dict[str, Any]
    ) -> Started: ...

    def facts(self, seen: Seen, *, status: int | None) -> tuple[dict[str, Any], dict[str, Any]]: ...


def egress_key(seen: Seen, body_sha256: str) -> str:
    return recorded_egress_key(seen.method, seen.url, body_sha256)


def what(seen: Seen) -> str:
    return f"{seen.method} {seen.url}"


async def chunks(body: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in body:
        yield chunk


class GoLive:
    """A miss that goes out (misses live): the body read already, and its key."""

    def __init__(self, body: list[bytes] | None, key: str) -> None:
        self.body, self.key = body, key


async def answer(
    proxy: Proxy,
    reads: Reads,
    client: Client,
    incoming: Incoming,
    seen: Seen,
    model: bool,
    started: float,
    *,
    sends_body: bool,
) -> bool | GoLive:
    """Serve one allowed request from the replay: whether the connection carries another
    (always False: a replayed answer ends its connection), or `GoLive` for a miss
    that goes out."""
    assert reads.replay is not None
    body: list[bytes] | None = None
    digest = hashlib.sha256()
    whole = True
    if not incoming.bodyless:
        if sends_body and b"100-continue" in incoming.fields.get(b"expect", b""):
            await client.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # else it waits to send
        body, size = [], 0
        cap = reads.recorder.settings.body_cap_bytes
        async for chunk in read_body(client, incoming, proxy.fill):
            digest.update(chunk)
            size += len(chunk)
            if size <= cap:
                body.append(chunk)
            else:
                whole, body = False, []
    key = egress_key(seen, digest.hexdigest())
    data = reads.replay.answer(key)
    category = "model" if model else "egress"
    if data is not None:
        logged = await proxy.begin_line(
            seen,
            "allow-listed read, answered from the recording this run replays",
            category=category,
            extra_detail={"replay": "hit", "replay_key": key},
        )
        tap = reads.recorder.tap(key, "egress", what(seen), replay="hit")
        client.tap, client.replying = tap, True
        try:
            await client.write(data)
        finally:
            client.tap = None
            tap.close()
            status = _status(data)
            proxy.log.outcome_queued(
                logged,
                ok=True,
                detail={"status": status, "replay": "hit", "reply_bytes": len(data)},
            )
        return False
    if reads.replay.miss_mode == "live" and whole:
        return GoLive(body, key)
    arguments, detail = proxy.facts(seen, status=503)
    detail.update(replay="miss", replay_key=key)
    await proxy.log.write(
        session="egress",
        tool="http",
        decision="allow",
        reason="replay miss: not in the recording this run replays; answered with a "
        "TEST MODE stub, not sent",
        category=category,
        arguments=arguments,
        duration_ms=(time.perf_counter() - started) * 1000,
        detail=detail,
    )
    reads.recorder.note_miss(key, "egress", what(seen))
    payload = (miss_text(what(seen)) + "\n").encode()
    await client.write(
        b"HTTP/1.1 503 Service Unavailable\r\n"
        b"Content-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: %d\r\n"
        b"X-Agentworks-Test-Mode: replay-miss\r\n"
        b"Connection: close\r\n\r\n%s" % (len(payload), payload)
    )
    return False


def _status(data: bytes) -> int | None:
    parts = data[:32].split(b" ", 2)
    try:
        return int(parts[1])
    except (IndexError, ValueError):
        return None
