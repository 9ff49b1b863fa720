"""The Docker Engine behind the run's seam (`sandbox.backends.Backend`).

A thin layer over `containers` and `images`: one `DockerClient` per test run,
every container it creates held by an `OwnedContainers`, and the exit watches it
started joined when it closes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

import docker.errors
import requests
from docker import DockerClient
from docker.models.containers import Container

from sandbox.backends import ContainerState, RunContainer
from sandbox.backends.docker import containers, images, prefetch, runtimes, userns
from sandbox.backends.docker.client import connect, unreachable
from sandbox.backends.docker.prefetch import engine_key
from sandbox.contracts.config import StepRuntime
from sandbox.contracts.errors import EngineError
from sandbox.contracts.ids import IdMap
from sandbox.contracts.names import LABEL_ROLE
from sandbox.contracts.record import OutputTail
from sandbox.contracts.spec import ContainerSpec


class DockerContainer:
    """One container of the run, through the Engine API."""

    def __init__(
        self,
        container: Container,
        watches: list[containers.ExitWatch],
        *,
        runtime: str | None = None,
        count_output: bool = False,
        counters: list[containers.OutputCounter] | None = None,
    ) -> None:
        self._container = container
        self._watches = watches
        self._runtime = runtime
        self._count_output = count_output
        self._counter: containers.OutputCounter | None = None
        self._counters = counters if counters is not None else []

    @property
    def name(self) -> str:
        return str(self._container.name)

    @property
    def id(self) -> str:
        return str(self._container.id)

    @property
    def user(self) -> str:
        return str(self._container.attrs.get("Config", {}).get("User", ""))

    def start(self) -> None:
        if self._count_output and self._counter is None:
            # Attached before it starts, so every byte it writes is counted (the
            # engine's capped log keeps only the last part of a flood).
            try:
                self._counter = containers.OutputCounter(self._container)
                self._counters.append(self._counter)
            except (docker.errors.APIError, requests.exceptions.RequestException) as exc:
                raise EngineError(f"cannot attach to {self.name}'s output: {exc}") from None
        self._container.start()

    def wait(self, timeout_s: float) -> int | None:
        return containers.wait(self._container, timeout_s)

    def kill(self) -> None:
        containers.kill(self._container)

    def stop(self, grace_s: int = 5) -> None:
        containers.stop(self._container, grace_s)

    def state(self) -> ContainerState:
        running, code = containers.is_running(self._container)
        state = self._container.attrs.get("State") or {}
        return ContainerState(
            running=running, exit_code=code, oom_killed=bool(state.get("OOMKilled"))
        )

    def output_tails(self) -> tuple[OutputTail, OutputTail]:
        """Counted as it came when it was attached to (the step), else what the
        engine's capped log kept."""
        if self._counter is None:
            return containers.output_tails(self._container)
        return self._counter.tails()

    def save_output(self, fd: int, cap_bytes: int) -> tuple[int, bool]:
        return containers.save_output(self._container, fd, cap_bytes)

    def follow_output(self, deadline_s: float) -> containers.OutputFollower:
        return containers.OutputFollower(self._container, deadline_s=deadline_s)

    def watch_exit(self, on_exit: Callable[[], None]) -> containers.ExitWatch:
        watch = containers.ExitWatch(self._container, on_exit=on_exit)
        self._watches.append(watch)
        return watch

    def watch_usage(self) -> containers.Usage:
        """Under a runtime other than the engine's default (gVisor's runsc), the executor
        sees no cgroup: the host reads the container's cgroup while it runs."""
        return containers.watch_usage(self._container, host_cgroup=self._runtime is not None)


class DockerBackend:
    """One test run's connection to the Docker engine."""

    engine_errors: tuple[type[Exception], ...] = (
        docker.errors.DockerException,
        requests.exceptions.RequestException,
    )
    kind: Literal["docker", "kubernetes"] = "docker"
    removes_each = True
    engine_label = "Docker engine"

    def __init__(self, client: DockerClient) -> None:
        self.client = client
        self._owned = containers.OwnedContainers(client)
        self._watches: list[containers.ExitWatch] = []
        self._counters: list[containers.OutputCounter] = []
        self._info: _InfoPrefetch | None = None

    @classmethod
    def connect(cls) -> DockerBackend:
        """A backend for the engine, or `EngineError` at its first call (`require_image`,
        `id_map`...) when the engine does not answer.

        The Engine API version is negotiated once per engine per process (a warm
        process, such as a controller calling `execute_step` run after run, spares
        each run that round trip); the first run's client asks, and an engine that
        changed its version since then is forgotten and named in the error. The
        engine's `/info` (its user-namespace remapping, its runtimes), which every run
        reads before its first container, is asked for at once in a thread: a run's
        image check, record and lock go on beside that round trip. A new `sandbox run`
        process asked for both as it started (`prefetch`): its first backend takes
        those answers instead."""
        key = engine_key()
        known = _API_VERSIONS.get(key)
        early = prefetch.take(CONNECT_TIMEOUT_S) if known is None else None
        version = known or (early.version if early is not None else "auto")
        client = connect(CONNECT_TIMEOUT_S, version=version)
        if known is None:
            _API_VERSIONS[key] = str(client.api.api_version)
        backend = cls(client)
        backend._info = _InfoPrefetch(backend.client, early.info if early is not None else None)
        return backend

    def require_image(self, ref: str) -> str:
        with _first_calls():
            return images.require(self.client, ref)

    def node(self) -> str | None:
        return None  # this host's engine

    def _engine_info(self) -> dict[str, Any]:
        with _first_calls():
            if self._info is not None:
                return self._info.result()
            return dict(self.client.info())

    def id_map(self) -> IdMap:
        return userns.id_map(self._engine_info())

    def require_step_runtime(self, runtime: StepRuntime) -> None:
        if runtime == "runsc":
            runtimes.require_runsc(self._engine_info())

    def create(self, spec: ContainerSpec, *, independent: bool = False) -> DockerContainer:
        return DockerContainer(
            self._owned.create(spec, independent=independent),
            self._watches,
            runtime=spec.runtime,
            count_output=spec.labels.get(LABEL_ROLE) == "step",
            counters=self._counters,
        )

    def connect_networks(self, container: RunContainer, networks: list[str]) -> None:
        containers.connect_networks(self.client, self._engine_side(container), networks)

    def remove_all(self) -> None:
        self._owned.remove_all()

    def remove_ahead(self, container: RunContainer) -> None:
        self._owned.remove_one(self._engine_side(container))

    def close(self) -> None:
        """Join the exit watches (they end once their container is gone), then close
        the client: its pooled connections must not outlive the run."""
        for watch in list(self._watches):
            watch.cancel()
            watch.join()
        for counter in self._counters:
            counter.close()
        if self._info is not None:
            self._info.join()
        with contextlib.suppress(Exception):
            self.client.close()

    @staticmethod
    def _engine_side(container: RunContainer) -> Container:
        if not isinstance(container, DockerContainer):
            raise TypeError(f"not a Docker container: {container!r}")
        return container._container


CONNECT_TIMEOUT_S = 60.0  # the client's timeout, and the longest wait for a prefetch

# The Engine API version each engine (by how the client finds it: `engine_key`)
# negotiated in this process: see `DockerBackend.connect`.
_API_VERSIONS: dict[tuple[str, ...], str] = {}


@contextlib.contextmanager
def _first_calls() -> Iterator[None]:
    """A run's first engine calls: an engine that does not answer is the connect's
    error (as when the version was asked at the connect); one whose API version
    changed since this process negotiated it is forgotten, so the next run asks."""
    try:
        yield
    except requests.exceptions.ConnectionError as exc:
        _API_VERSIONS.pop(engine_key(), None)
        raise unreachable(exc) from None
    except docker.errors.APIError as exc:
        if "client version" not in str(exc).lower():
            raise
        _API_VERSIONS.pop(engine_key(), None)
        raise EngineError(
            f"the Docker engine's API version changed during this process ({exc.explanation});"
            " run again"
        ) from None


class _InfoPrefetch:
    """The engine's `/info`, asked for in a thread as the backend connects (or the answer
    this process's start-up already had: `known`); `result()` waits for it and raises
    what the call raised (as a direct call would have)."""

    def __init__(self, client: DockerClient, known: dict[str, Any] | None = None) -> None:
        self._client = client
        self._info: dict[str, Any] | None = known
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._fetch, name="engine-info", daemon=True)
        if known is None:
            self._thread.start()

    def _fetch(self) -> None:
        try:
            self._info = dict(self._client.info())
        except BaseException as exc:  # handed to the caller of result()
            self._error = exc

    def result(self) -> dict[str, Any]:
        if self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._info is not None
        return self._info

    def join(self) -> None:
        """Before the client closes: the thread never outlives the backend."""
        if self._thread.ident is not None:
            self._thread.join()
