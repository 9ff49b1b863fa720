"""The engine's API version, asked for while a new `sandbox run` process starts.

The Docker SDK's client asks the engine for its API version when it is made
(`client.connect`): one round trip, after the command's imports (pydantic, the run's
models, the SDK itself: most of the process's start-up, all of it CPU). A process that
runs steps asks for it beside them instead: right after the command line is parsed,
`start()` sends the request the client would send (`GET /version`, on the engine's unix
socket) from a thread, and `client.connect` takes its `ApiVersion` instead of asking
again, as a warm process reuses the version its first run negotiated
(`DockerBackend.connect`). The engine works on the answer while the interpreter imports.

With the version known, the same thread asks for the engine's `/info` at that version
(`GET /v{version}/info`, the URL the client's `info()` asks), which every run reads
before its first container (its user-namespace remapping, its runtimes): a warm process
asks for it as each run's backend connects and waits for it some tens of ms later
(`DockerBackend.connect`); this process has it by the time its imports are done.

Only a plain answer counts: status 200, a JSON object (holding an `ApiVersion` that is a
version number, for `/version`), for the engine the client will talk to (the same
`DOCKER_*` settings, a unix socket, no TLS). Anything else leaves nothing, and the
client asks as it always did, so its error is the one the user sees. This module
imports only what the command line itself needs (no pydantic, no SDK), so the requests
leave before the heavy imports.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from dataclasses import dataclass
from typing import Any

DEFAULT_SOCKET = "/var/run/docker.sock"  # the SDK's default without DOCKER_HOST
ENGINE_ENV = ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH")
# A healthy engine answers in milliseconds; one that does not within this is left to
# the client (and its own timeout and error).
ANSWER_TIMEOUT_S = 10.0
MAX_ANSWER_BYTES = 64 * 1024  # `/version` is under 1 KiB
MAX_INFO_BYTES = 1024 * 1024  # `/info` is a few KiB
_VERSION = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}")


def engine_key() -> tuple[str, ...]:
    """What picks the engine the SDK's `from_env` talks to."""
    return tuple(os.environ.get(name, "") for name in ENGINE_ENV)


def engine_socket(key: tuple[str, ...]) -> str | None:
    """The unix socket of the engine `key` names; None for any other transport (TCP,
    SSH, TLS settings): the client's own connect handles those."""
    host, tls_verify, cert_path = key
    if tls_verify or cert_path:
        return None
    if not host:
        return DEFAULT_SOCKET
    if host.startswith("unix://") and len(host) > len("unix://"):
        return host[len("unix://") :]
    return None


def parse_object(raw: bytes) -> dict[str, Any] | None:
    """The JSON object of the engine's whole HTTP answer; None for anything but a 200
    whose body is one JSON object."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    status = head.split(b"\r\n", 1)[0].split(b" ")
    if len(status) < 2 or status[0] not in (b"HTTP/1.0", b"HTTP/1.1") or status[1] != b"200":
        return None
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def parse_answer(raw: bytes) -> str | None:
    """`ApiVersion` from the engine's whole HTTP answer to `GET /version`; None for
    anything but a 200 with a JSON object holding a version number."""
    answer = parse_object(raw)
    version = answer.get("ApiVersion") if answer is not None else None
    if not isinstance(version, str) or not _VERSION.fullmatch(version):
        return None
    return version


def _ask(path: str, url: str, max_bytes: int, timeout_s: float) -> bytes | None:
    """One `GET url` on the unix socket at `path` (HTTP/1.0: the engine closes the
    connection after its answer, so the answer is everything read); None on any error
    or an answer of more than `max_bytes`."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(f"GET {url} HTTP/1.0\r\nHost: docker\r\n\r\n".encode("ascii"))
            raw = b""
            while len(raw) <= max_bytes:
                chunk = sock.recv(max_bytes)
                if not chunk:
                    return raw
                raw += chunk
    except OSError:
        return None
    return None  # more than any such answer: not the engine's


def ask_version(path: str, timeout_s: float = ANSWER_TIMEOUT_S) -> str | None:
    """The engine's `ApiVersion` (`GET /version`); None on any error."""
    raw = _ask(path, "/version", MAX_ANSWER_BYTES, timeout_s)
    return None if raw is None else parse_answer(raw)


def ask_info(path: str, version: str, timeout_s: float = ANSWER_TIMEOUT_S) -> dict[str, Any] | None:
    """The engine's `/info` at API `version`, as the client's `info()` gets it; None on
    any error."""
    if not _VERSION.fullmatch(version):
        return None
    raw = _ask(path, f"/v{version}/info", MAX_INFO_BYTES, timeout_s)
    return None if raw is None else parse_object(raw)


@dataclass(frozen=True)
class Answers:
    """What the engine answered: its API version, and its `/info` at that version
    (None when that was not a plain answer: the backend then asks itself)."""

    version: str
    info: dict[str, Any] | None


class VersionPrefetch:
    """`GET /version`, then `/info` at that version, in a daemon thread (a hung engine
    never holds up the exit)."""

    def __init__(self, key: tuple[str, ...], path: str) -> None:
        self.key = key
        self._path = path
        self._answers: Answers | None = None
        self._thread = threading.Thread(target=self._ask, name="engine-version", daemon=True)
        self._thread.start()

    def _ask(self) -> None:
        version = ask_version(self._path)
        if version is not None:
            self._answers = Answers(version=version, info=ask_info(self._path, version))

    def result(self, timeout_s: float) -> Answers | None:
        """The answers, waiting at most `timeout_s` for them."""
        self._thread.join(timeout_s)
        return None if self._thread.is_alive() else self._answers


_pending: VersionPrefetch | None = None
_lock = threading.Lock()


def start() -> None:
    """Ask the engine the environment names for its version, in the background (once)."""
    global _pending
    key = engine_key()
    path = engine_socket(key)
    with _lock:
        if path is None or _pending is not None:
            return
        try:
            _pending = VersionPrefetch(key, path)
        except RuntimeError:  # no thread to be had: the client asks, as without this
            _pending = None


def take(timeout_s: float) -> Answers | None:
    """The prefetched answers for the engine the environment names now, once; None when
    none was asked for, it was for another engine, or the engine did not answer."""
    global _pending
    with _lock:
        pending, _pending = _pending, None
    if pending is None or pending.key != engine_key():
        return None
    return pending.result(timeout_s)
