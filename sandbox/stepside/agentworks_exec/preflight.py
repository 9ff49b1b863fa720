"""Preflight: before the step starts, prove from inside its namespace that the ways out are closed.

Stdlib only: installed in the step image as `agentworks_preflight` and run by the
executor as the step's user, in the step's network namespace, after the firewall
is installed and before the step command starts. Each check must END IN A
REFUSAL; anything that succeeds is a way out and the step never starts. It
takes a few milliseconds. What it does not check: the firewall rules
themselves (the guard's entry script checks them and prints them back before
the guard starts, which the executor waits for; the runner compares them too,
the first check in the record)
and anything the canary does not stand for (it proves one address is
unreachable, not all).

The firewall hands every TCP connection and every DNS query of the step to the
guard, so "closed" means: refused, or answered by this run's guard, which proves
it with HMAC-SHA256(bridge token, a fresh nonce) that nothing outside the run can
compute (`sandbox.guard.egress.transparent`, `sandbox.guard.egress.dns`). An answer without
the proof is a way out.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import time

# Not `typing.TYPE_CHECKING`: `typing` alone costs the executor's start-up ~10 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ENV = "AGENTWORKS_PREFLIGHT"
FAILED_EXIT = 97
MARK_OK = "AGENTWORKS_PREFLIGHT_OK"
MARK_FAILED = "AGENTWORKS_PREFLIGHT_FAILED"
ENGINE_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock", "/run/containerd/containerd.sock")
ENGINE_DNS = ("127.0.0.11", 53)
TIMEOUT_S = 0.5
# How long a connection or datagram that the firewall let through waits for the guard's
# proof: the guard listens at once but serves its DNS and interception a moment later
# (once its log is open and its network side is up, before its web stack loads), so the
# wait ends with the answer, not the timeout. That
# moment took over 10 s on a loaded shared host (a queued datagram answered just after a
# 10 s wait); the wait costs nothing when the answer comes sooner.
PROOF_TIMEOUT_S = 30.0
PROBE = b"AGENTWORKS-PREFLIGHT "  # sandbox.guard.egress.transparent.PREFLIGHT_PROBE
PROBE_ZONE = "agentworks-preflight.invalid"  # sandbox.guard.egress.dns.PREFLIGHT_ZONE
TOKEN_ENV = "AGENTWORKS_BRIDGE_TOKEN"


def _proof(nonce: str) -> bytes:
    key = os.environ.get(TOKEN_ENV, "").encode()
    return hmac.new(key, nonce.encode(), hashlib.sha256).hexdigest().encode()


def _guard_answered(reply: bytes, nonce: str) -> None:
    """Raise (a refusal: the run's guard took it) when `reply` carries the guard's proof."""
    if os.environ.get(TOKEN_ENV) and _proof(nonce) in reply:
        raise OSError(errno.ECONNREFUSED, "answered by the run's guard")


def _reply(sock: socket.socket) -> bytes:
    """What came back within the timeout (b"": nothing)."""
    sock.settimeout(PROOF_TIMEOUT_S)
    try:
        return sock.recv(4096)
    except TimeoutError:
        return b""


def _dns_query(nonce: str) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in [nonce, *PROBE_ZONE.split(".")])
    return struct.pack("!HHHHHH", 0x5A5A, 0x0100, 1, 0, 0, 0) + labels + b"\0\0\x10\0\x01"


def _refused(check: Any) -> str | None:
    """None when `check` raised (a refusal); else what was open."""
    try:
        opened = check()
    except OSError:
        return None
    return str(opened or "open")


def _raw() -> str:
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
    return "raw socket created"


def _icmp() -> str:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP).close()
    return "ICMP socket created"


def _packet() -> str:
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close()
    return "packet socket created"


def _udp(host: str, port: int, family: int = socket.AF_INET, *, dns: bool = False) -> str:
    nonce = secrets.token_hex(8)
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.sendto(_dns_query(nonce) if dns else b"preflight", (host, port))
        if dns:
            _guard_answered(_reply(sock), nonce)
    return f"UDP datagram to {host}:{port} left"


def _tcp(host: str, port: int, *, dns: bool = False) -> str:
    nonce = secrets.token_hex(8)
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
        if dns:
            query = _dns_query(nonce)
            sock.sendall(struct.pack("!H", len(query)) + query)
        else:
            sock.sendall(PROBE + nonce.encode() + b"\n")
        _guard_answered(_reply(sock), nonce)
        return f"TCP connection to {host}:{port} opened"


def _engine_socket() -> str:
    for path in ENGINE_SOCKETS:
        if os.path.exists(path):
            return f"{path} exists"
    raise OSError(errno.ENOENT, "no engine socket")


CLONE_NEWUSER = 0x10000000


def _user_namespace() -> str:
    """unshare(CLONE_NEWUSER) in a child: the step's seccomp profile refuses it (EPERM),
    so success means the profile is not in force (under gVisor: the engine's runsc
    runtime lacks --oci-seccomp and the sentry emulates the call)."""
    import ctypes

    pid = os.fork()
    if pid == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        code = 0 if libc.unshare(CLONE_NEWUSER) == 0 else min(ctypes.get_errno(), 250)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise OSError(code, os.strerror(code) if code > 0 else "killed")
    return "unshare(CLONE_NEWUSER) succeeded: the seccomp profile is not in force"


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# What needs no firewall: capabilities, the ICMP sysctl, files and the seccomp filter
# are all in force from the container's start, so these run while the executor waits
# for its guard (see `begin`).
def _local_checks() -> list[tuple[str, Any]]:
    return [
        ("raw socket", _raw),
        ("ICMP socket", _icmp),
        ("packet socket", _packet),
        ("engine socket", _engine_socket),
        ("user namespace (seccomp in force)", _user_namespace),
    ]


def _network_checks(config: dict[str, Any]) -> list[tuple[str, Any]]:
    """What the firewall closes: these run once the guard listens (its rules are in)."""
    checks: list[tuple[str, Any]] = [
        ("UDP to the engine's DNS", lambda: _udp(*ENGINE_DNS, dns=True)),
        ("TCP to the engine's DNS", lambda: _tcp(*ENGINE_DNS, dns=True)),
    ]
    for key, family in (("canary", socket.AF_INET), ("canary6", socket.AF_INET6)):
        address = config.get(key)
        if address:
            host, port = _split(str(address))
            checks.append((f"TCP to the canary {address}", lambda h=host, p=port: _tcp(h, p)))
            checks.append(
                (f"UDP to the canary {address}", lambda h=host, p=port, f=family: _udp(h, p, f))
            )
    return checks


class Pending:
    """A preflight whose checks that need no firewall ran; `finish` runs the rest."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.ms = 0.0
        self.names: list[str] = []
        self.found: list[str] = []

    def run(self, checks: list[tuple[str, Any]]) -> None:
        started = time.perf_counter()
        for name, check in checks:
            self.names.append(name)
            what = _refused(check)
            if what is not None:
                self.found.append(f"{name}: {what}")
        self.ms += (time.perf_counter() - started) * 1000

    def result(self) -> dict[str, Any]:
        return {
            "ok": not self.found,
            "ms": round(self.ms, 3),
            "checks": list(self.names),
            "open": list(self.found),
        }


def run(config: dict[str, Any]) -> dict[str, Any]:
    """All checks; `open` lists every way out found (`ms`: the time they took)."""
    pending = Pending(config)
    pending.run(_local_checks())
    pending.run(_network_checks(config))
    return pending.result()


def begin() -> Pending | None:
    """The preflight the environment asks for (None: none), its checks that need no
    firewall done. Nothing is reported yet: `finish` reports every check at once."""
    raw = os.environ.pop(ENV, None)
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except ValueError:
        config = {}
    pending = Pending(config if isinstance(config, dict) else {})
    pending.run(_local_checks())
    return pending


def finish(pending: Pending | None) -> int | None:
    """The network checks (call once the firewall is in), then the one report line on
    stderr; FAILED_EXIT when any check found a way out."""
    if pending is None:
        return None
    pending.run(_network_checks(pending.config))
    result = pending.result()
    marker = MARK_OK if result["ok"] else MARK_FAILED
    os.write(2, f"{marker} {json.dumps(result)}\n".encode())
    return None if result["ok"] else FAILED_EXIT


def gate() -> int | None:
    """Run the preflight the environment asks for; FAILED_EXIT when a way out is open."""
    return finish(begin())
