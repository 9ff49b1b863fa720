"""The guard's end of a stdio MCP server's socket, against a hostile peer (no engine).

The peer is a real thread speaking raw bytes on a real unix socket; the guard
side is `SocketSession`, as the MCP proxy uses it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from sandbox.guard.listeners import bind_unix
from sandbox.guard.mcp.sockets import (
    REPLY_TOO_LARGE,
    LineReader,
    MalformedReply,
    Oversized,
    SocketSession,
    open_socket_session,
)

CAP = 64 * 1024


def test_line_reader_passes_lines_and_drops_oversized_ones_unheld() -> None:
    reader = LineReader(cap=10)
    assert reader.feed(b'{"a":1}\n{"b"') == [b'{"a":1}']
    assert reader.feed(b":2}\n\n") == [b'{"b":2}']
    out = reader.feed(b'{"id": 7, "x": "' + b"y" * 50)
    assert out == [] and len(reader._partial) == 0  # nothing past the cap is kept
    out = reader.feed(b"z" * 5000 + b'", "id": 9}\nok\n')
    (big, small) = out
    assert isinstance(big, Oversized) and big.size == 16 + 50 + 5000 + 11
    assert big.candidate_ids() == [9, 7]  # the tail's id first (node servers write it last)
    assert small == b"ok"
    assert len(big.head) <= 4096 and len(big.tail) <= 4096


Peer = Callable[[socket.socket], None]


def _read_message(conn: socket.socket, buffer: bytearray) -> dict[str, Any]:
    while b"\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            raise EOFError
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return dict(json.loads(line))


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def hostile_server(on_call: Callable[[socket.socket, Any, dict[str, Any]], None]) -> Peer:
    """A raw JSON-RPC server: initialize, tools/list, and `on_call` for tools/call."""

    def run(conn: socket.socket) -> None:
        buffer = bytearray()
        try:
            while True:
                message = _read_message(conn, buffer)
                if "id" not in message:
                    continue
                method, rid = message.get("method"), message["id"]
                if method == "initialize":
                    result = {
                        "protocolVersion": message["params"]["protocolVersion"],
                        "capabilities": {"tools": {}},
                        "serverInfo": {"name": "hostile", "version": "1"},
                    }
                    _send(conn, {"jsonrpc": "2.0", "id": rid, "result": result})
                elif method == "tools/call":
                    on_call(conn, rid, message["params"])
                elif method == "tools/list":
                    _send(conn, {"jsonrpc": "2.0", "id": rid, "result": {"tools": []}})
                else:
                    error = {"code": -32601, "message": "no"}
                    _send(conn, {"jsonrpc": "2.0", "id": rid, "error": error})
        except (EOFError, OSError):
            pass

    return run


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path / "mcp.sock")


def _with_peer(path: str, peer: Peer, body: Callable[[SocketSession], Any], **kw: Any) -> Any:
    listener = bind_unix(path)
    client_sock = socket.socket(socket.AF_UNIX)
    client_sock.connect(path)
    thread = threading.Thread(target=peer, args=(client_sock,), daemon=True)
    thread.start()

    async def main() -> Any:
        async with open_socket_session(
            listener,
            expected_uid=kw.get("uid", os.getuid()),
            accept_deadline_s=5,
            client_info={"name": "t", "version": "1"},
            cap=CAP,
        ) as session:
            return await body(session)

    try:
        return anyio.run(main)
    finally:
        client_sock.close()
        thread.join(timeout=5)


def test_an_oversized_result_is_an_error_naming_the_cap(socket_path: str) -> None:
    def big(conn: socket.socket, rid: Any, params: dict[str, Any]) -> None:
        if params["name"] == "big":
            text = "x" * (CAP * 4)
            result = {"content": [{"type": "text", "text": text}]}
            conn.sendall(json.dumps({"result": result, "jsonrpc": "2.0", "id": rid}).encode())
            conn.sendall(b"\n")
        else:
            _send(conn, {"jsonrpc": "2.0", "id": rid, "result": {"content": []}})

    async def body(session: SocketSession) -> tuple[MCPError, Any]:
        with pytest.raises(MCPError) as caught:
            await session.request("tools/call", {"name": "big"}, 5)
        after = await session.request("tools/call", {"name": "small"}, 5)
        return caught.value, after

    error, after = _with_peer(socket_path, hostile_server(big), body)
    assert error.code == REPLY_TOO_LARGE
    assert "larger than the guard's cap of 64 KiB" in error.message
    assert after == {"content": []}  # the connection goes on after the dropped message


def test_unasked_traffic_never_reaches_the_client(socket_path: str) -> None:
    """Notifications, answers to nothing, and the server's own requests: dropped or
    refused here; the one real answer still arrives."""
    seen_replies: list[dict[str, Any]] = []

    def noisy(conn: socket.socket, rid: Any, params: dict[str, Any]) -> None:
        for n in range(50):
            _send(conn, {"jsonrpc": "2.0", "method": "notifications/message", "params": {"n": n}})
            _send(conn, {"jsonrpc": "2.0", "id": 10_000 + n, "result": {"forged": True}})
        _send(conn, {"jsonrpc": "2.0", "id": "s1", "method": "sampling/createMessage"})
        _send(conn, {"jsonrpc": "2.0", "id": "s2", "method": "ping"})
        buffer = bytearray()
        seen_replies.extend(_read_message(conn, buffer) for _ in range(2))
        result = {"content": [{"type": "text", "text": "real"}]}
        _send(conn, {"jsonrpc": "2.0", "id": rid, "result": result})

    async def body(session: SocketSession) -> Any:
        return await session.request("tools/call", {"name": "x"}, 5)

    result = _with_peer(socket_path, hostile_server(noisy), body)
    assert result["content"][0]["text"] == "real"
    assert seen_replies[0]["id"] == "s1" and seen_replies[0]["error"]["code"] == -32601
    assert seen_replies[1] == {"jsonrpc": "2.0", "id": "s2", "result": {}}


def test_a_peer_of_another_uid_is_refused(socket_path: str) -> None:
    with pytest.raises(Exception) as caught:
        _with_peer(
            socket_path, hostile_server(lambda *a: None), lambda c: anyio.sleep(0), uid=12345
        )
    assert "not the server's" in repr(caught.value)


def test_deep_json_from_either_side_is_dropped(socket_path: str) -> None:
    """A reply nested past the SDK parser's depth is never delivered (the call waits
    out its budget); a request that deep is refused before it is sent."""
    deep = "x"
    for _ in range(400):
        deep = f"[{deep}]"
    asked: list[str] = []

    def nested(conn: socket.socket, rid: Any, params: dict[str, Any]) -> None:
        asked.append(params["name"])
        if params["name"] == "deep":
            line = (
                '{"jsonrpc": "2.0", "id": ' + json.dumps(rid) + ', "result": {"x": ' + deep + "}}"
            )
            conn.sendall(line.encode() + b"\n")
        else:
            _send(conn, {"jsonrpc": "2.0", "id": rid, "result": {"content": []}})

    async def body(session: SocketSession) -> tuple[int, int, Any]:
        with pytest.raises(MCPError) as late:
            await session.request("tools/call", {"name": "deep"}, 0.5)
        too_deep: Any = "x"
        for _ in range(400):
            too_deep = [too_deep]
        with pytest.raises(MCPError) as refused:
            await session.request("tools/call", {"name": "out", "arguments": {"a": too_deep}}, 5)
        return (
            late.value.code,
            refused.value.code,
            await session.request("tools/call", {"name": "ok"}, 5),
        )

    late, refused, after = _with_peer(socket_path, hostile_server(nested), body)
    assert late == types.REQUEST_TIMEOUT and refused == types.INVALID_PARAMS
    assert after == {"content": []} and asked == ["deep", "ok"]


def test_a_server_that_dies_or_answers_badly_fails_its_callers(socket_path: str) -> None:
    def dies(conn: socket.socket, rid: Any, params: dict[str, Any]) -> None:
        if params["name"] == "bad":
            _send(conn, {"jsonrpc": "2.0", "id": rid, "result": [1, 2]})
        elif params["name"] == "err":
            _send(conn, {"jsonrpc": "2.0", "id": rid, "error": {"code": -32602, "message": "no"}})
        else:
            conn.shutdown(socket.SHUT_RDWR)

    async def body(session: SocketSession) -> list[Any]:
        out: list[Any] = []
        with pytest.raises(MalformedReply):
            await session.request("tools/call", {"name": "bad"}, 5)
        with pytest.raises(MCPError) as error:
            await session.request("tools/call", {"name": "err"}, 5)
        out.append((error.value.code, error.value.message))
        for name in ("die", "after"):
            with pytest.raises(MCPError) as closed:
                await session.request("tools/call", {"name": name}, 5)
            out.append(closed.value.code)
        return out

    out = _with_peer(socket_path, hostile_server(dies), body)
    assert out == [(-32602, "no"), types.CONNECTION_CLOSED, types.CONNECTION_CLOSED]
