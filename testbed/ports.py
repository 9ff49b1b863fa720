"""Loopback ports for the tests and the local cluster, which start servers of their own."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """Distinct loopback ports free right now (all held open together while picking)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
