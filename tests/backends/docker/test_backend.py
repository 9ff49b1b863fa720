"""A run's engine connection: the API version negotiated once per engine per process,
and an engine that does not answer still named as such at the run's first call.

No engine needed: the engine here is a socket path where nothing listens (a real
connection refused, not a stand-in)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.backends.docker import backend, prefetch
from sandbox.backends.docker.backend import DockerBackend
from sandbox.contracts.errors import EngineError


@pytest.fixture
def nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, ...]:
    """DOCKER_HOST at a socket path nobody listens on."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-engine.sock'}")
    monkeypatch.delenv("DOCKER_TLS_VERIFY", raising=False)
    monkeypatch.delenv("DOCKER_CERT_PATH", raising=False)
    return prefetch.engine_key()


def test_an_engine_that_never_answered_fails_at_the_connect(nowhere: tuple[str, ...]) -> None:
    with pytest.raises(EngineError, match="Docker engine not reachable"):
        DockerBackend.connect()
    assert nowhere not in backend._API_VERSIONS


def test_with_a_known_version_the_first_call_says_the_engine_is_gone(
    nowhere: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that answered earlier in this process and is gone now: the connect asks
    nothing, the run's first call fails with the connect's error, and the version is
    forgotten (the next run asks again)."""
    monkeypatch.setitem(backend._API_VERSIONS, nowhere, "1.41")
    connected = DockerBackend.connect()
    try:
        with pytest.raises(EngineError, match="Docker engine not reachable"):
            connected.require_image("sandbox-step:any")
        assert nowhere not in backend._API_VERSIONS
        with pytest.raises(EngineError, match="Docker engine not reachable"):
            connected.id_map()
    finally:
        connected.close()
