"""The guard's HTTP cycle (`sandbox.guard.serve.OneWriteCycle`): a reply with a length
goes out as one write (its head with its body), and nothing else changes: the order
of the bytes and of the close, a HEAD's head, a chunked stream's head at once.

uvicorn's own cycle, driven as uvicorn drives it, on a transport that records what
it is asked to do (the process-level tests in tests/guard/test_process.py cover the
same replies over real sockets)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl

from sandbox.guard.serve import OneWriteCycle


class _Transport:
    """What the cycle did to its transport, in order."""

    def __init__(self) -> None:
        self.done: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        assert not self.closing, "a write after the close"
        self.done.append(("write", data))

    def close(self) -> None:
        self.closing = True
        self.done.append(("close", b""))

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def _cycle(
    method: str = "POST", *, keep_alive: bool = True, expect_100: bool = False
) -> tuple[OneWriteCycle, _Transport, list[bool]]:
    transport = _Transport()
    completed: list[bool] = []

    def on_response() -> None:  # uvicorn's protocol looks at the transport here
        completed.append(transport.is_closing())

    cycle = OneWriteCycle(
        scope={"method": method, "path": "/v1/tools/call", "http_version": "1.1"},  # type: ignore[typeddict-item]
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=False,
        default_headers=[],
        message_event=asyncio.Event(),
        expect_100_continue=expect_100,
        keep_alive=keep_alive,
        on_response=on_response,
    )
    return cycle, transport, completed


def _start(length: int | None, *, close: bool = False) -> Any:
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.insert(0, (b"content-length", str(length).encode()))
    if close:
        headers.append((b"connection", b"close"))
    return {"type": "http.response.start", "status": 200, "headers": headers}


def _body(data: bytes, more: bool = False) -> Any:
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_a_reply_with_a_length_is_one_write_of_its_head_and_body() -> None:
    async def main() -> None:
        cycle, transport, completed = _cycle()
        await cycle.send(_start(7))
        assert transport.done == []  # held for its body
        await cycle.send(_body(b'{"a":1}'))
        [(what, data)] = transport.done
        assert what == "write"
        assert data.startswith(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n")
        assert data.endswith(b'\r\n\r\n{"a":1}')
        assert completed == [False] and cycle.response_complete

    asyncio.run(main())


def test_a_closing_reply_writes_head_and_body_before_its_close() -> None:
    """`Connection: close` (a refusal's) and a connection not kept alive: the bytes go
    out first, then the close, and uvicorn's protocol sees the close when the cycle
    ends (it starts no pipelined request on it)."""

    async def main() -> None:
        for close, keep_alive in ((True, True), (False, False)):
            cycle, transport, completed = _cycle(keep_alive=keep_alive)
            await cycle.send(_start(2, close=close))
            await cycle.send(_body(b"{}"))
            assert [what for what, _ in transport.done] == ["write", "close"]
            assert transport.done[0][1].endswith(b"\r\n\r\n{}")
            assert completed == [True]

    asyncio.run(main())


def test_a_body_in_pieces_has_its_head_with_the_first_piece_only() -> None:
    async def main() -> None:
        cycle, transport, _ = _cycle()
        await cycle.send(_start(4))
        await cycle.send(_body(b"ab", more=True))
        await cycle.send(_body(b"cd"))
        assert [what for what, _ in transport.done] == ["write", "write"]
        assert transport.done[0][1].endswith(b"\r\n\r\nab") and transport.done[1][1] == b"cd"

    asyncio.run(main())


def test_a_head_is_written_at_once_when_no_body_write_is_sure_to_follow() -> None:
    """A chunked reply (an MCP event stream may wait long for its first event), a HEAD
    (uvicorn writes no body for it) and a reply a 100 Continue may still precede."""

    async def main() -> None:
        cycle, transport, _ = _cycle()
        await cycle.send(_start(None))
        [(what, data)] = transport.done
        assert what == "write" and b"transfer-encoding: chunked" in data
        await cycle.send(_body(b"event", more=True))
        assert transport.done[1] == ("write", b"5\r\nevent\r\n")

        cycle, transport, _ = _cycle("HEAD")
        await cycle.send(_start(7))
        assert [what for what, _ in transport.done] == ["write"]
        await cycle.send(_body(b""))
        assert len(transport.done) == 1 and cycle.response_complete

        cycle, transport, _ = _cycle(expect_100=True)
        await cycle.send(_start(2))
        assert [what for what, _ in transport.done] == ["write"]

    asyncio.run(main())


def test_a_held_head_goes_out_before_the_close_of_a_failed_reply() -> None:
    """The app fails after its start (uvicorn then closes the connection): the head is
    written, then the close, as without the hold."""

    async def main() -> None:
        cycle, transport, _ = _cycle()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await send(_start(7))
            raise RuntimeError("boom")

        await cycle.run_asgi(app)
        assert [what for what, _ in transport.done] == ["write", "close"]
        assert transport.done[0][1].startswith(b"HTTP/1.1 200 OK\r\n")

    asyncio.run(main())
