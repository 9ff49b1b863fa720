"""The guard's pre-bound listeners behave like ones asyncio made itself."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path

import pytest

from sandbox.guard.listeners import bind_loopback, bind_unix


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_connections_accepted_on_a_prebound_socket_have_nodelay() -> None:
    """Without TCP_NODELAY a keep-alive client waits 40 ms (delayed ACK) per reply."""

    async def scenario() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listener = bind_loopback(_free_port())
        server = await asyncio.start_server(accepted, sock=listener)
        async with server:
            _, client = await asyncio.open_connection(*listener.getsockname())
            result = await asyncio.wait_for(seen, 10)
            client.close()
            return result

    assert asyncio.run(scenario()) != 0


def test_the_port_listens_on_loopback_only_and_is_not_inherited() -> None:
    listener = bind_loopback(_free_port())
    try:
        assert listener.getsockname()[0] == "127.0.0.1"
        assert not listener.get_inheritable()
        with socket.create_connection(listener.getsockname(), timeout=5):
            pass
    finally:
        listener.close()


def test_an_mcp_socket_appears_at_its_path_only_ready_for_the_servers_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server's relay connects the moment the path exists and retries only while it is
    missing or refuses: had the socket been there still with the umask's mode (0755, no
    write for the server's group), the relay got EACCES and the server never started
    (seen in a full suite run under load). So at the moments its mode is set and it is
    renamed into place, nothing may be at the path yet, and it listens before it is."""
    path = tmp_path / "mcp.sock"
    path.write_text("a stale socket of an earlier guard")
    (tmp_path / "mcp.sock.binding").write_text("a staging name left by a killed guard")
    moments: list[tuple[str, bool]] = []
    real_chmod, real_rename = os.chmod, os.rename

    def chmod(target: str, mode: int) -> None:
        moments.append(("mode set", path.exists()))
        real_chmod(target, mode)

    def rename(source: str, target: str) -> None:
        moments.append(("renamed", path.exists()))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as early:
            early.connect(source)  # already listening: a relay would not be refused
        real_rename(source, target)

    monkeypatch.setattr(os, "chmod", chmod)
    monkeypatch.setattr(os, "rename", rename)
    listener = bind_unix(str(path))
    monkeypatch.undo()
    try:
        assert moments == [("mode set", False), ("renamed", False)]
        info = path.lstat()
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mcp.sock"]
        assert not listener.get_inheritable()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as relay:
            relay.connect(str(path))
    finally:
        listener.close()
