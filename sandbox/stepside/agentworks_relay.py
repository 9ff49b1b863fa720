"""The entry point of a stdio MCP server's container: the server's stdio, over a socket.

Standard library only; installed with the step side (the MCP image is built on the
step image) and run as `/usr/bin/python3 -m agentworks_relay`. It connects to the
unix socket the guard listens on in the server's own folder (mounted read-only at
`/run/mcp`; the guard may still be starting, so it retries until a deadline), and
starts the server command with that connected socket itself as its stdin and
stdout: no byte of the MCP conversation passes through the relay process (a copy
loop here cost a thread hop and two copies per message each way). The relay then
only waits for the server and passes SIGTERM on. The server's stderr is the
container's, which only the host reads.

With `--proxy-port`, it also listens on 127.0.0.1:PORT in the server's own
network namespace (which has nothing else: no interface but loopback) and
tunnels each connection to the guard's egress socket for this server, where
the guard's egress proxy applies this server's allow list. The server's
HTTP(S)_PROXY names that port.

The relay runs as the server's uid and is no boundary: everything it passes
is treated by the guard as the server's own bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

CONNECT_DEADLINE_S = 60.0
CHUNK = 64 * 1024


def _say(message: str) -> None:
    print(f"mcp-relay: {message}", file=sys.stderr, flush=True)


def connect_unix(path: str, deadline_s: float) -> socket.socket:
    """Connect to the guard's socket, waiting (briefly, repeatedly) for it to listen."""
    end = time.monotonic() + deadline_s
    pause = 0.005
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() >= end:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def _pump(
    read: Callable[[], bytes], write: Callable[[bytes], object], done: Callable[[], None]
) -> None:
    """Copy until EOF or error; then end the writing side."""
    try:
        while True:
            data = read()
            if not data:
                break
            write(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            done()


def _tunnel(client: socket.socket, egress_socket: str) -> None:
    """One proxy connection of the server, to the guard's egress socket."""
    try:
        upstream = connect_unix(egress_socket, 5.0)
    except OSError as exc:
        _say(f"egress socket unreachable: {exc}")
        client.close()
        return
    up = threading.Thread(
        target=_pump,
        args=(
            lambda: client.recv(CHUNK),
            upstream.sendall,
            lambda: upstream.shutdown(socket.SHUT_WR),
        ),
        daemon=True,
    )
    up.start()
    _pump(lambda: upstream.recv(CHUNK), client.sendall, lambda: client.shutdown(socket.SHUT_WR))
    up.join()
    client.close()
    upstream.close()


def serve_proxy(port: int, egress_socket: str) -> None:
    listener = socket.create_server(("127.0.0.1", port))

    def accept() -> None:
        while True:
            client, _ = listener.accept()
            threading.Thread(target=_tunnel, args=(client, egress_socket), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcp-relay")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--egress-socket")
    parser.add_argument("--proxy-port", type=int)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        _say("no server command")
        return 2
    if args.proxy_port and args.egress_socket:
        serve_proxy(args.proxy_port, args.egress_socket)
    try:
        guard = connect_unix(args.socket, CONNECT_DEADLINE_S)
    except OSError as exc:
        _say(f"the guard's socket {args.socket} is unreachable: {exc}")
        return 1
    try:
        # The socket is the server's stdio (a read on stdin is a recv, a write on
        # stdout a send); the relay's own copy is closed so that the server's
        # exit is the guard's EOF.
        server = subprocess.Popen(command, stdin=guard.fileno(), stdout=guard.fileno())
    except OSError as exc:
        _say(f"cannot start {command[0]}: {exc}")
        guard.close()
        return 127
    guard.close()
    signal.signal(signal.SIGTERM, lambda *_: server.terminate())
    code = server.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
