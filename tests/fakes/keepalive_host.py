"""A fake outside host for keep-alive tests: raw HTTP/1.1 on loopback that counts its
connections and the requests each one carried, and frames its replies as the path asks.

Paths (any GET or HEAD):
- `/len/...`: a Content-Length reply, connection kept open;
- `/chunked/...`: a chunked reply, kept open;
- `/close/...`: a Content-Length reply with `Connection: close`, then the close;
- `/http10/...`: an HTTP/1.0 reply (no keep-alive), then the close;
- `/extra/...`: a Content-Length reply followed by stray bytes nobody asked for;
- `/split/...`: a Content-Length reply whose head and body go in two sends (as
  Python's http.server writes them), kept open; `/splitextra/...` the same with
  stray bytes in the second send (counted in `Seen.strays_sent` once sent, so a
  test can wait until they are on the proxy's side before its next request);
- `/lateextra/...`: a Content-Length reply, kept open, whose stray bytes go only
  once the next request on that connection arrived, just before its reply (a host
  that misbehaves after the proxy already reused the connection);
- `/quiet-close/...`: a Content-Length reply, then the close, without saying so;
- `/drop/...`: no reply at all: the connection closes once the request arrived;
- `/big/<n>/...`: a Content-Length reply of `n` bytes of `big_body(n)`, kept open (a
  body large enough for the proxy to splice); `/bigextra/<n>/...` the same followed by
  stray bytes.

It reads each request head whole (requests here carry no body) and answers in
order; it never reads ahead of what it answered, so a request it counts is a
request that arrived. Runs as a thread of the test process (the "outside world";
the proxy under test is the real code).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field

from tests.fakes.loopback import LoopbackServer


def big_body(size: int) -> bytes:
    """`size` bytes of a pattern that shows where a byte was lost or added."""
    return (bytes(range(256)) * (size // 256 + 1))[:size]


@dataclass
class Seen:
    """Requests per connection, in arrival order: (connection number, method, path)."""

    requests: list[tuple[int, str, str]] = field(default_factory=list)
    connections: int = 0
    strays_sent: int = 0  # replies whose stray bytes have been sent


class KeepAliveHost:
    def __init__(self) -> None:
        self.seen = Seen()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._server = LoopbackServer(self._serve)
        self.port = self._server.port

    def _serve(self, conn: socket.socket, number: int) -> None:
        with self._lock:
            self.seen.connections += 1
            self._conns.append(conn)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = b""
        owed = b""  # a /lateextra/ reply's stray bytes, sent before the next reply
        with conn, contextlib.suppress(OSError):
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buffer += chunk
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                method, path, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
                with self._lock:
                    self.seen.requests.append((number, method, path))
                if path.startswith("/drop/"):
                    return
                if owed:
                    conn.sendall(owed)
                    owed = b""
                    self._stray_sent()
                body = f"hello {path}".encode()
                if path.startswith(("/big/", "/bigextra/")):
                    body = big_body(int(path.split("/")[2]))
                shown = b"" if method == "HEAD" else body
                kind = path.split("/")[1]
                if kind == "chunked":
                    data = b"" if method == "HEAD" else b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + data)
                    continue
                version = b"HTTP/1.0" if kind == "http10" else b"HTTP/1.1"
                extra = b"Connection: close\r\n" if kind == "close" else b""
                reply = b"%s 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (version, len(body), extra)
                stray = b"stray bytes" if kind in ("extra", "bigextra", "splitextra") else b""
                if kind in ("split", "splitextra"):
                    conn.sendall(reply)
                    conn.sendall(shown + stray)
                else:
                    conn.sendall(reply + shown + stray)
                if stray:
                    self._stray_sent()
                if kind == "lateextra":
                    owed = b"stray bytes"
                if kind in ("close", "http10", "quiet-close"):
                    return

    def _stray_sent(self) -> None:
        with self._lock:
            self.seen.strays_sent += 1

    def drop_connections(self) -> None:
        """Close every connection this host has (an idle timeout on the host's side)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._server.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
