"""The accept loop the suite's raw loopback servers share: a TCP server on 127.0.0.1
that hands each connection to `serve(conn, number)` in a thread of its own (numbered
from 1 in accept order) until it is closed. What a server answers is its own; how it
accepts is written once. `busy` says how many connections are still being served, for
a test that counts descriptors once every handler is done."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


class LoopbackServer:
    def __init__(self, serve: Callable[[socket.socket, int], None]) -> None:
        self._serve = serve
        self._lock = threading.Lock()
        self._busy = 0  # connections whose `serve` has not returned yet
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._srv.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        number = 0
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return  # closed
            number += 1
            with self._lock:
                self._busy += 1
            threading.Thread(target=self._serving, args=(conn, number), daemon=True).start()

    def _serving(self, conn: socket.socket, number: int) -> None:
        try:
            self._serve(conn, number)
        finally:
            with self._lock:
                self._busy -= 1

    @property
    def busy(self) -> int:
        """How many accepted connections are still being served (their thread runs)."""
        with self._lock:
            return self._busy

    def close(self) -> None:
        self._srv.close()
