"""A fake "outside" server for egress tests (stdlib only; runs in its own container).

HTTP/1.1 on 8080 with keep-alive (GET/HEAD answer, every request recorded with the
number of the connection it came on, body hashed), a plain
TCP listener on 8443 standing in for an HTTPS site (records connections), and a
UDP listener on 9999 (records datagrams). `GET /__seen` returns the record.
On 8081 a sloppy HTTP server: it answers the first request and then records
every request line that still arrives on the connection, `Connection: close` or
not, so a test can see whether any byte of a pipelined request left the proxy.
On 8082 (plain) and 8445 (TLS) a raw server: it answers each head it sees with
a fixed reply (so a proxy may keep the connection) and records every byte each
connection brought, until the peer closes; `GET /__raw` on 8080 returns them (base64, one entry per
connection), so a test can compare what arrived with what the proxy logged.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SEEN: list[dict[str, object]] = []
LOCK = threading.Lock()
CONNECTIONS = [0]  # HTTP connections accepted on 8080 (each request notes its own)


def note(entry: dict[str, object]) -> None:
    with LOCK:
        SEEN.append(entry)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two sends; with Nagle on, each keep-alive reply
    # waits for the client's delayed ACK (about 40 ms).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: object) -> None:
        return

    def setup(self) -> None:
        super().setup()
        with LOCK:
            CONNECTIONS[0] += 1
            self.connection_number = CONNECTIONS[0]

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _answer(self, payload: bytes, head_only: bool = False) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if not head_only:
            self.wfile.write(payload)

    def do_GET(self) -> None:
        if self.path in ("/__seen", "/__raw"):
            with LOCK:
                data = json.dumps(SEEN if self.path == "/__seen" else RAW).encode()
            self._answer(data)
            return
        note({"proto": "http", "method": "GET", "path": self.path, "conn": self.connection_number})
        if self.path.startswith("/bytes/"):
            n = int(self.path.rsplit("/", 1)[1])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            block = b"x" * 65536
            while n > 0:
                chunk = block[: min(n, len(block))]
                self.wfile.write(chunk)
                n -= len(chunk)
            return
        self._answer(b"hello from outside " + self.path.encode())

    def do_HEAD(self) -> None:
        note({"proto": "http", "method": "HEAD", "path": self.path})
        self._answer(b"hello from outside " + self.path.encode(), head_only=True)

    def _effect(self) -> None:
        body = self._body()
        note(
            {
                "proto": "http",
                "method": self.command,
                "path": self.path,
                "sha256": hashlib.sha256(body).hexdigest(),
            }
        )
        self._answer(b"done")

    do_POST = do_PUT = do_PATCH = do_DELETE = _effect


def tcp_listener(port: int) -> None:
    family = socket.AF_INET6
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("::", port))
    srv.listen(16)
    while True:
        conn, addr = srv.accept()
        note({"proto": "tcp", "port": port, "peer": addr[0]})
        conn.close()


METHODS = (b"GET ", b"HEAD ", b"POST ", b"PUT ", b"PATCH ", b"DELETE ", b"OPTIONS ")


def sloppy_connection(conn: socket.socket) -> None:
    received = b""
    answered = False
    with conn:
        conn.settimeout(30)
        while True:
            try:
                chunk = conn.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            received += chunk
            if not answered and b"\r\n\r\n" in received:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsloppy")
                answered = True
    for line in received.split(b"\r\n"):
        if line.startswith(METHODS):
            method, _, rest = line.decode("latin-1").partition(" ")
            note({"proto": "sloppy", "method": method, "path": rest.rsplit(" ", 1)[0]})


def sloppy_listener(port: int) -> None:
    srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("::", port))
    srv.listen(16)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=sloppy_connection, args=(conn,), daemon=True).start()


RAW: list[str] = []


def raw_connection(conn: socket.socket) -> None:
    import base64

    received = b""
    answered = 0
    with conn:
        conn.settimeout(30)
        while True:
            try:
                chunk = conn.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            received += chunk
            while received.count(b"\r\n\r\n") > answered:  # one reply per head, in order
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nraw")
                answered += 1
    with LOCK:
        RAW.append(base64.b64encode(received).decode())


def raw_listener(port: int, tls: bool) -> None:
    srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("::", port))
    srv.listen(16)
    context = None
    if tls:
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain("/srv/tls/server.pem")
    while True:
        conn, _ = srv.accept()
        if context is not None:
            try:
                conn.settimeout(30)
                conn = context.wrap_socket(conn, server_side=True)
            except OSError:
                conn.close()
                continue
        threading.Thread(target=raw_connection, args=(conn,), daemon=True).start()


def udp_listener(port: int) -> None:
    srv = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    srv.bind(("::", port))
    while True:
        data, addr = srv.recvfrom(65536)
        note({"proto": "udp", "port": port, "peer": addr[0], "bytes": len(data)})


class DualStackServer(ThreadingHTTPServer):
    address_family = socket.AF_INET6
    daemon_threads = True


def https_server(port: int) -> None:
    """The same handler over TLS, when the harness gave us a certificate."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain("/srv/tls/server.pem")
    server = DualStackServer(("::", port), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.serve_forever()


def main() -> int:
    import os

    if os.path.exists("/srv/tls/server.pem"):
        threading.Thread(target=https_server, args=(8444,), daemon=True).start()
        threading.Thread(target=raw_listener, args=(8445, True), daemon=True).start()
    threading.Thread(target=raw_listener, args=(8082, False), daemon=True).start()
    threading.Thread(target=tcp_listener, args=(8443,), daemon=True).start()
    threading.Thread(target=sloppy_listener, args=(8081,), daemon=True).start()
    threading.Thread(target=udp_listener, args=(9999,), daemon=True).start()
    DualStackServer(("::", 8080), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
