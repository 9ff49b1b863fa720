"""The guard's transport to a URL MCP server: streamable HTTP with every reply capped.

A URL server is third-party code on the network, so its JSON replies are read at
most `MAX_MCP_MESSAGE_BYTES` (an event stream is capped per event by the SDK), as a
stdio server's are on its socket."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx2
from mcp.client._transport import TransportStreams
from mcp.client.streamable_http import streamable_http_client

from sandbox.guard import limits

CAP_MARK = "larger than the guard's cap"  # in every error that says a reply was too large


class _ReplyCapExceeded(httpx2.StreamError):
    """A URL server's JSON reply passed MAX_MCP_MESSAGE_BYTES."""


class _CappedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, cap: int) -> None:
        self._inner = inner
        self._cap = cap

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._cap:
                raise _ReplyCapExceeded(
                    f"the MCP server's reply was {CAP_MARK} of {limits.mib(self._cap)}; "
                    "it was dropped"
                )
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class _CappedTransport(httpx2.AsyncHTTPTransport):
    """JSON replies read at most MAX_MCP_MESSAGE_BYTES (an event stream is capped per
    event by the SDK's `max_sse_event_size`)."""

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await super().handle_async_request(request)
        if response.headers.get("content-type", "").startswith("application/json"):
            stream = response.stream
            assert isinstance(stream, httpx2.AsyncByteStream)
            response.stream = _CappedStream(stream, limits.MAX_MCP_MESSAGE_BYTES)
        return response


@contextlib.asynccontextmanager
async def http_transport(url: str) -> AsyncIterator[TransportStreams]:
    """Streamable HTTP with no proxy from the environment, no idle keep-alive, and
    replies capped like a stdio server's.

    A fresh TCP connection per request costs a fraction of a millisecond on the
    networks a guard joins, and a redeployed server (new address, same name) is
    reached at the next request instead of through a dead pooled connection."""
    client = httpx2.AsyncClient(
        timeout=httpx2.Timeout(30.0, read=300.0),
        transport=_CappedTransport(limits=httpx2.Limits(max_keepalive_connections=0)),
        trust_env=False,
    )
    async with (
        client,
        streamable_http_client(
            url, http_client=client, max_sse_event_size=limits.MAX_MCP_MESSAGE_BYTES
        ) as streams,
    ):
        yield streams
