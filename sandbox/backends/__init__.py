"""Backends: the seam between the run's phases and a container engine.

A test run's phases (`sandbox.run`) describe containers as pure `ContainerSpec`s
(`sandbox.launch`) and drive them only through the two interfaces below; nothing
outside a backend package imports an engine's client library. `docker/` is the
Docker Engine backend (`sandbox.backends.docker.DockerBackend`); a Kubernetes
backend sits beside it as `kubernetes/`, implementing the same two interfaces.

The contract a backend keeps, whatever its engine:

- `Backend` is one connection for one test run. Every container it creates is
  tracked the moment it exists and removed by `remove_all()`, also when the run
  is interrupted; `close()` ends every thread the backend started and closes its
  connection. Failures of the engine itself surface as one of `engine_errors` (or
  as `sandbox.contracts.errors.EngineError`), which the run records as an error.
- `RunContainer` is one created container. `wait` returns None on timeout and
  never raises for a container that is gone; `kill` and `stop` are no-ops on one
  that is gone; output is read from what the engine kept (capped on its side).
- The watchers (`follow_output`, `watch_exit`, `watch_usage`) run in the
  backend's threads and call back from them; each stops when told (`cancel`,
  `finish`, leaving the context) and never outlives `Backend.close()`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

# The contracts' models are only named in annotations here: importing the seam (and the
# engine packages under it, such as `docker.prefetch`) loads no pydantic.
if TYPE_CHECKING:
    from sandbox.contracts.config import StepRuntime
    from sandbox.contracts.ids import IdMap
    from sandbox.contracts.record import OutputTail, PeakMemorySource
    from sandbox.contracts.spec import ContainerSpec


@dataclass(frozen=True)
class ContainerState:
    """A container as the engine sees it now."""

    running: bool
    exit_code: int | None  # None while running, or when the engine no longer knows it
    oom_killed: bool = False


class OutputLines(Protocol):
    """A container's output lines as they come (attached before it starts)."""

    def wait_for_line(self, line: str) -> bool:
        """True once `line` was printed; False when the output ended or the deadline passed."""
        ...

    def lines(self) -> list[str]: ...

    def tail(self, count: int = 3) -> str:
        """The last non-empty lines, for an error message."""
        ...


class ExitWatcher(Protocol):
    """Calls back (from a thread) if the container stops before `cancel()`."""

    def cancel(self) -> None: ...


class UsageWatcher(Protocol):
    """Peak memory and CPU seen while the container ran, sampled until `finish()`;
    `peak_memory_source` names where the engine's peak came from (`host_cgroup` or
    `engine_stats`; None: no figure)."""

    peak_memory_bytes: int | None
    peak_memory_source: PeakMemorySource | None
    cpu_seconds: float | None

    def finish(self) -> None: ...


class RunContainer(Protocol):
    """One container a `Backend` created for the run."""

    @property
    def name(self) -> str: ...

    @property
    def id(self) -> str: ...

    @property
    def user(self) -> str:
        """The `uid[:gid]` it runs as, as created."""
        ...

    def start(self) -> None: ...

    def wait(self, timeout_s: float) -> int | None:
        """The exit code, or None when the timeout passed first (or it is gone)."""
        ...

    def kill(self) -> None:
        """SIGKILL every process in it and wait for its end."""
        ...

    def stop(self, grace_s: int = 5) -> None:
        """SIGTERM, then SIGKILL after the grace period."""
        ...

    def state(self) -> ContainerState: ...

    def output_tails(self) -> tuple[OutputTail, OutputTail]:
        """The tails of its stdout and of its stderr."""
        ...

    def save_output(self, fd: int, cap_bytes: int) -> tuple[int, bool]:
        """Its output so far into `fd`, at most `cap_bytes`: bytes written, whether cut."""
        ...

    def follow_output(self, deadline_s: float) -> AbstractContextManager[OutputLines]:
        """Its output lines from the start, until the context is left or the deadline."""
        ...

    def watch_exit(self, on_exit: Callable[[], None]) -> ExitWatcher: ...

    def watch_usage(self) -> UsageWatcher: ...


class Backend(Protocol):
    """One test run's connection to a container engine."""

    engine_errors: tuple[type[Exception], ...]
    kind: Literal["docker", "kubernetes"]  # the record's `backend`
    # Whether one container can be removed ahead of the others (`remove_ahead`);
    # False: they go only together, with `remove_all` (one Pod).
    removes_each: bool
    engine_label: str  # for a reason: "the Docker engine failed during the run: ..."

    def node(self) -> str | None:
        """Where the containers ran, when the engine spans machines (a cluster's node)."""
        ...

    def require_image(self, ref: str) -> str:
        """The image's id, or `EngineError` saying how to build it."""
        ...

    def id_map(self) -> IdMap:
        """How the engine maps container ids to host ids (user-namespace remapping):
        what the runner chowns a container's folders to. `EngineError` when unknown."""
        ...

    def require_step_runtime(self, runtime: StepRuntime) -> None:
        """`EngineError` unless the engine can run the step under `runtime` as
        `sandbox.launch.runtime` needs it (for runsc: passthrough network, the OCI
        seccomp profile applied)."""
        ...

    def create(self, spec: ContainerSpec, *, independent: bool = False) -> RunContainer:
        """Create (not start) a hardened container. `independent`: it shares no
        namespace with the others, so it may be removed at the same time as they are."""
        ...

    def connect_networks(self, container: RunContainer, networks: list[str]) -> None:
        """Attach a created container to more (existing) networks."""
        ...

    def remove_all(self) -> None:
        """Remove every container this backend created, newest first; idempotent."""
        ...

    def remove_ahead(self, container: RunContainer) -> None:
        """Remove one container whose state and output were read, ahead of `remove_all`
        (which then skips it), while the engine does the run's other work; it is gone
        on return. Only where `removes_each`."""
        ...

    def close(self) -> None:
        """End the backend's threads and its connection (after `remove_all`)."""
        ...


BackendFactory = Callable[[], Backend]
