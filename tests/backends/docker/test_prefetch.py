"""The engine's API version and `/info` asked for while `sandbox run` starts
(`docker.prefetch`): the same answers the client's own negotiation and `info()` get,
taken once and only for the engine the environment names, and nothing (the client
asks itself) on any other answer.

The engine's answers are real: the host's engine, or a unix socket in the test's
folder that a thread serves with fixed bytes (the answer parser's cases)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.backends.docker import prefetch
from sandbox.backends.docker.backend import DockerBackend
from sandbox.backends.docker.client import connect
from sandbox.cli.parser import build_parser
from sandbox.cli.startup import runs_on_docker
from sandbox.contracts import hostpath
from sandbox.contracts.errors import EngineError

OK = b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{"ApiVersion":"1.41"}'


@pytest.fixture(autouse=True)
def no_pending() -> Iterator[None]:
    """Each test starts and ends with no prefetch pending in this process."""
    prefetch.take(0)
    yield
    prefetch.take(10)


def serve_once(path: Path, answer: bytes) -> threading.Thread:
    """A unix socket at `path` that answers one request with `answer`, then closes."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def answer_one() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(answer)

    thread = threading.Thread(target=answer_one, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def engine_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """DOCKER_HOST at a socket path in the test's folder."""
    path = tmp_path / "engine.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    monkeypatch.delenv("DOCKER_TLS_VERIFY", raising=False)
    monkeypatch.delenv("DOCKER_CERT_PATH", raising=False)
    return path


@pytest.mark.parametrize(
    ("answer", "version"),
    [
        (OK, "1.41"),
        (b"HTTP/1.1 200 OK\r\n\r\n" + b'{"ApiVersion":"1.43","Version":"24"}', "1.43"),
        (b"HTTP/1.0 500 Internal Server Error\r\n\r\n" + b'{"ApiVersion":"1.41"}', None),
        (b"HTTP/1.0 200 OK\r\n\r\n" + b'{"ApiVersion":"1.41 or so"}', None),
        (b"HTTP/1.0 200 OK\r\n\r\n" + b'{"ApiVersion":141}', None),
        (b"HTTP/1.0 200 OK\r\n\r\n" + b'["1.41"]', None),
        (b"HTTP/1.0 200 OK\r\n\r\n" + b"not json", None),
        (b'HTTP/1.0 200 OK\r\n{"ApiVersion":"1.41"}', None),  # no end of the head
        (b"SSH-2.0-OpenSSH\r\n\r\n", None),
        (b"", None),
    ],
)
def test_only_a_plain_answer_gives_a_version(
    engine_at: Path, answer: bytes, version: str | None
) -> None:
    served = serve_once(engine_at, answer)
    assert prefetch.ask_version(str(engine_at), timeout_s=30) == version
    served.join(30)


def test_an_answer_larger_than_any_version_gives_none(engine_at: Path) -> None:
    served = serve_once(engine_at, OK + b" " * (prefetch.MAX_ANSWER_BYTES + 1))
    assert prefetch.ask_version(str(engine_at), timeout_s=30) is None
    served.join(30)


def test_no_engine_listening_gives_none_and_the_client_says_unreachable(
    engine_at: Path,
) -> None:
    prefetch.start()
    assert prefetch.take(30) is None
    prefetch.start()
    with pytest.raises(Exception, match="Docker engine not reachable"):
        connect()


def test_the_prefetched_version_is_the_clients_taken_once(engine_at: Path) -> None:
    served = serve_once(engine_at, OK)
    prefetch.start()
    served.join(30)
    client = connect()  # asks nothing: nobody listens any more
    try:
        assert client.api.api_version == "1.41"
    finally:
        client.close()
    assert prefetch.take(0) is None


def test_a_prefetch_for_another_engine_is_not_taken(
    engine_at: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve_once(engine_at, OK)
    prefetch.start()
    served.join(30)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{engine_at}.other")
    assert prefetch.take(30) is None


@pytest.mark.parametrize(
    ("env", "path"),
    [
        (("", "", ""), prefetch.DEFAULT_SOCKET),
        (("unix:///run/other.sock", "", ""), "/run/other.sock"),
        (("unix://", "", ""), None),
        (("tcp://127.0.0.1:2375", "", ""), None),
        (("ssh://user@host", "", ""), None),
        (("unix:///run/other.sock", "1", ""), None),
        (("", "", "/certs"), None),
    ],
)
def test_only_a_unix_socket_without_tls_is_asked(
    env: tuple[str, str, str], path: str | None
) -> None:
    assert prefetch.engine_socket(env) == path


def test_the_hosts_engine_gives_what_the_client_negotiates(engine: DockerClient) -> None:
    path = prefetch.engine_socket(prefetch.engine_key())
    if path is None:
        pytest.skip("the host's engine is not on a unix socket: nothing is prefetched")
    assert prefetch.ask_version(path) == engine.version()["ApiVersion"]


@pytest.mark.parametrize(
    ("argv", "host_config", "asked"),
    [
        (["run", "wf", "s"], None, True),
        (["run", "wf", "s", "--backend", "docker"], "kubernetes", True),
        (["run", "wf", "s", "--backend", "kubernetes"], None, False),
        (["run", "wf", "s"], "docker", False),  # a host config: known only once read
        (["verify", "wf", "s", "--host-config", "x.toml"], None, False),
    ],
)
def test_the_cli_asks_only_when_docker_runs_without_a_host_config(
    argv: list[str],
    host_config: str | None,
    asked: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SANDBOX_HOST_CONFIG", raising=False)
    if host_config is not None:
        config = tmp_path / "host.toml"
        config.write_text(f'[backend]\nkind = "{host_config}"\n', encoding="utf-8")
        monkeypatch.setenv("SANDBOX_HOST_CONFIG", str(config))
    monkeypatch.setattr(hostpath, "DEFAULT_PATH", tmp_path / "absent.toml")
    assert runs_on_docker(build_parser().parse_args(argv)) is asked


def serve_in_turn(path: Path, answers: list[bytes], asked: list[bytes]) -> threading.Thread:
    """A unix socket at `path` that answers one request per answer, in turn, and notes
    each request's first line in `asked`; then it closes."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(len(answers))

    def answer_each() -> None:
        with server:
            for answer in answers:
                conn, _ = server.accept()
                with conn:
                    asked.append(conn.recv(4096).split(b"\r\n", 1)[0])
                    conn.sendall(answer)

    thread = threading.Thread(target=answer_each, daemon=True)
    thread.start()
    return thread


REMAPPED_INFO = (
    b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n"
    b'{"SecurityOptions":["name=seccomp,profile=builtin","name=userns"],'
    b'"DockerRootDir":"/var/lib/docker/231072.231072"}'
)


def test_the_prefetched_info_is_the_first_backends_at_the_version_it_asked(
    engine_at: Path,
) -> None:
    asked: list[bytes] = []
    served = serve_in_turn(engine_at, [OK, REMAPPED_INFO], asked)
    prefetch.start()
    served.join(30)
    backend = DockerBackend.connect()  # asks nothing more: nobody listens any more
    try:
        ids = backend.id_map()
    finally:
        backend.close()
    assert asked == [b"GET /version HTTP/1.0", b"GET /v1.41/info HTTP/1.0"]
    assert ids.remapped and ids.uid_base == 231072


@pytest.mark.parametrize(
    "info",
    [
        b"HTTP/1.0 500 Internal Server Error\r\n\r\n{}",
        b"HTTP/1.0 200 OK\r\n\r\n[]",
        b"HTTP/1.0 200 OK\r\n\r\n{not json",
        b"",
    ],
)
def test_an_info_that_is_not_a_plain_answer_is_asked_again_by_the_backend(
    engine_at: Path, info: bytes
) -> None:
    asked: list[bytes] = []
    served = serve_in_turn(engine_at, [OK, info], asked)
    prefetch.start()
    served.join(30)
    backend = DockerBackend.connect()
    try:
        # The backend asks the engine itself: gone now, so the run's usual error.
        with pytest.raises(EngineError, match="Docker engine not reachable"):
            backend.id_map()
    finally:
        backend.close()
    assert len(asked) == 2


def test_the_hosts_engine_gives_the_info_the_client_gets(engine: DockerClient) -> None:
    path = prefetch.engine_socket(prefetch.engine_key())
    if path is None:
        pytest.skip("the host's engine is not on a unix socket: nothing is prefetched")
    version = prefetch.ask_version(path)
    assert version is not None
    early = prefetch.ask_info(path, version)
    assert early is not None
    info = engine.info()
    # What a run reads from it (and what names the engine); counters and clocks move.
    for key in ("ID", "SecurityOptions", "DockerRootDir", "Runtimes", "DefaultRuntime"):
        assert early.get(key) == info.get(key), key
