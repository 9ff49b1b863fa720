"""The guard's pre-bound listeners behave like ones asyncio made itself."""

from __future__ import annotations

import asyncio
import socket

from sandbox.guard.listeners import bind_loopback


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
