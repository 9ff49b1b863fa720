"""Connecting to the engine, with one clear error when it does not answer, and its facts."""

from __future__ import annotations

from typing import Any

import docker
import docker.errors
from docker import DockerClient as DockerClient  # re-exported: the type the CLI and doctor hold

from sandbox.backends.docker import prefetch
from sandbox.contracts.errors import EngineError

ENGINE_HINT = "start it with `make engine` (installs docker.io and starts dockerd as root)"


def connect(timeout_s: float = 60.0, *, version: str = "auto") -> DockerClient:
    """A client whose engine has answered, or EngineError. (The client asks the engine
    for its API version when it is made: that answer is the liveness check, one round
    trip, no separate ping.) With a known `version` nothing is asked here: the
    caller's first call is the check (see `DockerBackend.connect`). "auto" takes the
    answer a step-running process asked for as it started (`prefetch`), when there is
    one for this engine: that process's first call is then the check."""
    if version == "auto":
        answers = prefetch.take(timeout_s)
        version = answers.version if answers is not None else "auto"
    try:
        client = docker.from_env(timeout=int(timeout_s), version=version)
    except docker.errors.DockerException as exc:
        raise unreachable(exc) from None
    return client


def unreachable(exc: BaseException) -> EngineError:
    """The error for an engine that did not answer (at the connect, or at the first
    call of a client whose version was known)."""
    return EngineError(f"Docker engine not reachable ({_short(exc)}); {ENGINE_HINT}")


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


def engine_info(client: DockerClient) -> dict[str, Any]:
    """The engine's `/info` (versions, security options, cgroup driver...)."""
    return dict(client.info())


def api_version(client: DockerClient) -> str:
    """The engine's Engine API version; "0" for an engine too old to say."""
    try:
        return str(client.version().get("ApiVersion") or "0")
    except Exception:
        return "0"
