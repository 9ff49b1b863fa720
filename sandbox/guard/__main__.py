"""`python -m sandbox.guard`: bind the ports, then start the guard from its config file.

The guard's modules (`sandbox.guard.startup`: pydantic, the config's models, the
network side) load first: in a Docker run the entry's install subshell puts the
firewall's rules in beside this interpreter (`sandbox.launch.firewall`), and nothing
is bound until its gate says they are in and read back right; a gate that closes
without that ends the guard before it listens (fail closed: the step's executor
starts the step only once the guard listens). The guard is non-dumpable from the
moment it holds the config's text (both tokens); once the ports and the MCP servers'
sockets listen (see `sandbox.guard.listeners`), `sandbox.guard.startup` takes over:
config, log and policy, the network side, then the web stack.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import socket
import sys
from collections.abc import Callable

from sandbox.contracts.guardprocess import FIREWALL_GATE_FD_ENV, FIREWALL_GATE_OK
from sandbox.contracts.noplugins import without_plugin_loader
from sandbox.guard.listeners import (
    BRIDGE_PORT,
    CONFIG_FILE_ENV,
    DNS_PORT,
    EGRESS_PORT,
    TRANSPARENT_PORT,
    bind_loopback,
    bind_udp_loopback,
    bind_unix,
    make_undumpable,
)
from sandbox.guard.nflog import inherited

MCP_SOCKET = "mcp.sock"  # sandbox.contracts.layout.MCP_SOCKET (not imported: stdlib only here)
MCP_EGRESS_SOCKET = "egress.sock"  # sandbox.contracts.layout.MCP_EGRESS_SOCKET


def _take_config_text() -> bytes | None:
    """Read the config file once and remove it, so nothing started later can read it
    (a read-only Secret mount stays: see the comment below)."""
    path = os.environ.pop(CONFIG_FILE_ENV, None)
    if not path:
        print(f"guard: {CONFIG_FILE_ENV} is not set", file=sys.stderr)
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(4 * 1024 * 1024)
        try:
            os.unlink(path)
        except OSError as exc:
            # A Kubernetes Secret is a read-only mount only this container has; the
            # runner deletes the Secret itself, and nothing the guard starts runs here.
            if exc.errno != errno.EROFS:
                raise
    except OSError as exc:
        print(f"guard: config file {path} unreadable: {exc}", file=sys.stderr)
        return None
    return raw


def _firewall_in() -> bool:
    """Whether the firewall's gate the entry handed this process (if any) says the rules
    are in and read back right: blocks until the install script writes to it or ends.
    No gate (a Pod, whose init container installed the rules before any of its
    containers started; the test-only entry that installs none): True."""
    raw = os.environ.pop(FIREWALL_GATE_FD_ENV, None)
    if raw is None:
        return True
    if not raw.isdigit():
        return False
    fd = int(raw)
    got = b""
    try:
        while b"\n" not in got and len(got) <= len(FIREWALL_GATE_OK):
            chunk = os.read(fd, len(FIREWALL_GATE_OK))
            if not chunk:
                break  # the script ended without opening the gate
            got += chunk
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return got == FIREWALL_GATE_OK


def _port(document: object, key: str, default: int) -> int:
    value = document.get(key, default) if isinstance(document, dict) else default
    return value if isinstance(value, int) and 0 < value < 65536 else default


def _mcp_sockets(document: object) -> tuple[dict[str, socket.socket], dict[str, socket.socket]]:
    """Each stdio server's socket (and its egress socket, when it has an allow list)."""
    stdio: dict[str, socket.socket] = {}
    egress: dict[str, socket.socket] = {}
    if not isinstance(document, dict):
        return stdio, egress
    folder = document.get("mcp_dir")
    for server in document.get("mcp_servers") or []:
        if not isinstance(server, dict) or not server.get("command") or not folder:
            continue
        name = str(server.get("name"))
        if "/" in name or name.startswith("."):
            continue  # the config validates names; never build a path from a bad one
        base = os.path.join(str(folder), name)
        stdio[name] = bind_unix(os.path.join(base, MCP_SOCKET))
        if server.get("egress"):
            egress[name] = bind_unix(os.path.join(base, MCP_EGRESS_SOCKET))
    return stdio, egress


def _load() -> Callable[..., int]:
    """The guard's modules (`sandbox.guard.startup`: the config, the log, then the network
    side), loaded while the firewall goes in (the longest part of the guard's start); they
    bind, read and serve nothing. pydantic loads no plugin: none would see the config's
    tokens, and none is looked up (`sandbox.contracts.noplugins`)."""
    without_plugin_loader()
    from sandbox.guard.startup import serve

    return serve


def main() -> int:
    # No cyclic collection until the network side serves (`sandbox.guard.startup`
    # turns it back on): the start-up's imports and models allocate tens of thousands
    # of objects that all stay, and the collector's passes over them were some 8-12 ms
    # of the CPU on the way to the preflight's proofs, for nothing to collect.
    gc.disable()
    raw = _take_config_text()
    if raw is None:
        return 2
    # The text holds both tokens: before anything else loads or starts.
    if not make_undumpable():
        print("guard: cannot make itself non-dumpable", file=sys.stderr)
        return 2
    try:
        document = json.loads(raw)
    except ValueError as exc:
        print(f"guard: config file is not JSON: {exc}", file=sys.stderr)
        return 2
    serve = _load()
    if not _firewall_in():
        print("guard: the firewall did not come up; not listening", file=sys.stderr)
        return 2
    try:
        # Egress first: the bridge port listening is what the step waits for.
        egress = bind_loopback(_port(document, "egress_port", EGRESS_PORT))
        # The firewall redirects the step's direct connections and DNS queries here.
        direct = (
            bind_loopback(TRANSPARENT_PORT),
            bind_udp_loopback(DNS_PORT),
            bind_loopback(DNS_PORT),
        )
        bridge = bind_loopback(_port(document, "bridge_port", BRIDGE_PORT))
        mcp, mcp_egress = _mcp_sockets(document)
    except OSError as exc:
        print(f"guard: cannot listen: {exc}", file=sys.stderr)
        return 2
    return serve(
        raw,
        bridge=bridge,
        egress=egress,
        mcp=mcp,
        mcp_egress=mcp_egress,
        direct=direct,
        packets=inherited(),  # the firewall's log of refused packets, bound by the entry
    )


if __name__ == "__main__":
    sys.exit(main())
