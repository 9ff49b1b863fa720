"""The guard's keep-alive client against real servers on loopback (asyncio, in-process)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from sandbox.guard.upstream import UpstreamClient, UpstreamError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


def test_keep_alive_content_length_and_chunked() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            if body == b"chunked":
                writer.write(
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
                )
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    async def main() -> None:
        server, url = await _serve(handler)
        client = UpstreamClient(url)
        try:
            first = await client.post("/x", b"hello", {}, timeout=5)
            second = await client.post("/x", b"chunked", {}, timeout=5)
            third = await client.post("/x", b"again", {}, timeout=5)
        finally:
            await client.aclose()
            server.close()
        assert (first.status, first.body) == (200, b"hello")
        assert second.body == b"abcde"
        assert third.body == b"again"
        assert connections == 1  # one kept-alive connection carried all three

    asyncio.run(main())


def test_a_stale_connection_is_retried_once_and_timeouts_abandon_it() -> None:
    async def close_after_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await _read_request(reader)
        if body == b"slow":
            await asyncio.sleep(5)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # without saying Connection: close

    async def main() -> None:
        server, url = await _serve(close_after_one)
        client = UpstreamClient(url)
        try:
            assert (await client.post("/", b"a", {}, timeout=5)).body == b"ok"
            assert (await client.post("/", b"b", {}, timeout=5)).body == b"ok"  # stale: retried
            with pytest.raises(TimeoutError):
                await client.post("/", b"slow", {}, timeout=0.3)
            assert (await client.post("/", b"c", {}, timeout=5)).body == b"ok"
        finally:
            await client.aclose()
            server.close()

    asyncio.run(main())


def test_unreachable_and_malformed_are_upstream_errors() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"NOT HTTP\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main() -> None:
        server, url = await _serve(garbage)
        port = int(url.rsplit(":", 1)[1])
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await UpstreamClient(f"http://127.0.0.1:{port}").post("/", b"x", {}, timeout=5)
        server, url = await _serve(garbage)
        try:
            with pytest.raises(UpstreamError, match="malformed status line"):
                await UpstreamClient(url).post("/", b"x", {}, timeout=5)
        finally:
            server.close()

    asyncio.run(main())
