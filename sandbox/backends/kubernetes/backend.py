"""The Kubernetes backend behind the run's seam (`sandbox.backends.Backend`): one Pod.

The run creates its containers one by one, as on Docker: the guard, then the step.
Here `create` only takes each spec; the guard's `start` makes the Pod once both are
in (`pod.pod_manifest`), with the guard's config moved from the file the run wrote
for it into the run's Secret (the host file is removed, as the guard removes it on
Docker). What the run then asks of each container is answered from the Pod's watch:

- the guard's output while it starts is the init container's log (the firewall's
  read-back and its ready line), so the run checks the same read-back as on Docker;
- `wait`, `state`, `watch_exit` read the watch; `kill` and `stop` stop the whole Pod
  (no container of a Pod can be killed alone), its logs read just before;
- each container's log is both its streams (`output_tails` gives it as stderr, where
  the run reads the executor's report lines);
- no live usage samples (no metrics server is assumed): the executor's own report
  gives the step's peak memory and CPU.

Stdio MCP servers are containers of the same Pod (`pod.pod_manifest` says how they
are kept apart in its shared network namespace): the run creates each one as an
independent container, as on Docker; the Pod is made once the guard's config (which
names every server's uid) and every server's spec are in.

Refused, with a message, before anything runs: Docker networks for the guard.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

from sandbox import stopsignals
from sandbox.backends import ContainerState, RunContainer
from sandbox.contracts import names
from sandbox.contracts.config import StepRuntime
from sandbox.contracts.errors import ConfigError, EngineError, LaunchError
from sandbox.contracts.guardconfig import CONFIG_FILE_NAME, DATA_DIR
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.ids import NO_REMAP, IdMap
from sandbox.contracts.layout import MCP_UID_BASE
from sandbox.contracts.names import LABEL_ROLE
from sandbox.contracts.record import OutputTail, PeakMemorySource
from sandbox.contracts.spec import ContainerSpec
from sandbox.launch.runtime import POD_RUNSC_REFUSAL

from . import pod as manifests
from .podrun import ENGINE_ERRORS, PodRun, PodView, connect

CONFIG_MAX_BYTES = 1000 * 1000  # a Secret holds at most 1 MiB
SPECS_DEADLINE_S = 60.0  # the step's spec is made beside the guard's start
STOP_DEADLINE_S = 60.0


class _InitOutput:
    """The guard's start-up output: the firewall init container's log, once it ended."""

    def __init__(self, backend: KubernetesBackend, deadline_s: float) -> None:
        self._backend = backend
        self._deadline = time.monotonic() + deadline_s
        self._lines: list[str] = []

    def wait_for_line(self, line: str) -> bool:
        run = self._backend.pod_run()
        left = max(0.0, self._deadline - time.monotonic())
        run.wait_for(lambda v: v.firewall.exit_code is not None or v.over or bool(v.stuck()), left)
        self._lines = run.log_tail(manifests.FIREWALL).text.splitlines()
        return run.view.firewall.exit_code == 0 and line in self._lines

    def lines(self) -> list[str]:
        return list(self._lines)

    def tail(self, count: int = 3) -> str:
        view = self._backend.pod_run().view
        said = [ln for ln in self._lines if ln.strip()][-count:]
        stuck = view.stuck()
        return " | ".join([*said, *([stuck] if stuck else [])]) or f"Pod phase {view.phase!r}"


class _ExitWatch:
    """Calls back (from its own thread) once the container ended, unless cancelled."""

    def __init__(self, backend: KubernetesBackend, role: str, on_exit: Callable[[], None]):
        self._cancelled = threading.Event()

        def follow() -> None:
            run = backend.pod_run()
            while not self._cancelled.is_set():
                try:
                    ended = run.wait_for(
                        lambda v: v.role(role).exit_code is not None or v.over, 1.0
                    )
                except EngineError:
                    return
                if ended and not self._cancelled.is_set() and not run.view.gone:
                    with contextlib.suppress(Exception):
                        on_exit()
                    return
                if run.view.gone:
                    return

        self._thread = threading.Thread(target=follow, name=f"exit watch {role}", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._cancelled.set()

    def join(self, timeout_s: float = 5.0) -> None:
        self._thread.join(timeout=timeout_s)


class _NoUsage:
    """The Pod API has no live usage without a metrics server."""

    peak_memory_bytes: int | None = None
    peak_memory_source: PeakMemorySource | None = None
    cpu_seconds: float | None = None

    def finish(self) -> None:
        return None


class PodContainer:
    """The guard or the step, as one container of the run's Pod."""

    def __init__(self, backend: KubernetesBackend, role: str, spec: ContainerSpec) -> None:
        self._backend = backend
        self.role = role
        self.spec = spec

    @property
    def name(self) -> str:
        return f"{manifests.object_name(self.spec.labels[names.LABEL_RUN_ID])}/{self.role}"

    @property
    def id(self) -> str:
        return self.name

    @property
    def user(self) -> str:
        return self.spec.user

    def start(self) -> None:
        run = self._backend.pod_run()
        if self.role == manifests.GUARD:
            return
        role = self.role

        def begun(v: PodView) -> bool:
            return v.role(role).running or v.role(role).exit_code is not None

        run.wait_for(lambda v: begun(v) or v.over or bool(v.stuck()), STOP_DEADLINE_S)
        view = run.view
        if view.stuck():
            raise LaunchError(f"a container of the run's Pod cannot start: {view.stuck()}")
        if not begun(view):
            raise LaunchError(f"the run's {role} did not start (Pod phase {view.phase!r})")

    def wait(self, timeout_s: float) -> int | None:
        run = self._backend.pod_run()
        if self.role == manifests.STEP:
            # The Pod ends by itself past the step's timeout, even if the runner dies.
            run.patch(manifests.deadline_patch(self._backend.pod_age_s(), timeout_s))
        ended = run.wait_for(lambda v: v.role(self.role).exit_code is not None or v.over, timeout_s)
        if not ended:
            return None
        # A Pod that ended (killed, past its deadline) says its containers' codes a
        # moment later.
        run.wait_for(lambda v: v.role(self.role).exit_code is not None or v.gone, STOP_DEADLINE_S)
        code = run.view.role(self.role).exit_code
        if code is None:
            raise EngineError(f"the Pod ended and its {self.role}'s exit code is unknown")
        return code

    def kill(self) -> None:
        run = self._backend.pod_run()
        run.kill()
        run.wait_for(lambda v: v.role(self.role).exit_code is not None or v.gone, STOP_DEADLINE_S)

    def stop(self, grace_s: int = 5) -> None:
        self.kill()  # the Pod's grace period (a few seconds) applies

    def state(self) -> ContainerState:
        role = self._backend.pod_run().view.role(self.role)
        return ContainerState(
            running=role.running, exit_code=role.exit_code, oom_killed=role.reason == "OOMKilled"
        )

    def output_tails(self) -> tuple[OutputTail, OutputTail]:
        return OutputTail(), self._backend.pod_run().log_tail(self.role)

    def save_output(self, fd: int, cap_bytes: int) -> tuple[int, bool]:
        data = self._backend.pod_run().log_tail(self.role)
        raw = data.text.encode()[:cap_bytes]
        os.write(fd, raw)
        return len(raw), data.truncated or len(raw) < len(data.text.encode())

    @contextlib.contextmanager
    def _follow(self, deadline_s: float) -> Iterator[_InitOutput]:
        yield _InitOutput(self._backend, deadline_s)

    def follow_output(self, deadline_s: float) -> contextlib.AbstractContextManager[_InitOutput]:
        return self._follow(deadline_s)

    def watch_exit(self, on_exit: Callable[[], None]) -> _ExitWatch:
        watch = _ExitWatch(self._backend, self.role, on_exit)
        self._backend.exit_watches.append(watch)
        return watch

    def watch_usage(self) -> _NoUsage:
        return _NoUsage()


class KubernetesBackend:
    """One test run's Pod on a cluster (one API connection, closed with the run)."""

    engine_errors: tuple[type[Exception], ...] = ENGINE_ERRORS
    kind: Literal["docker", "kubernetes"] = "kubernetes"
    removes_each = False  # a Pod's containers go with the Pod (`remove_all`)
    engine_label = "Kubernetes cluster"

    def __init__(self, settings: BackendConfig, api: Any) -> None:
        self.settings = settings
        self.api = api
        self.exit_watches: list[_ExitWatch] = []
        self._specs: dict[str, PodContainer] = {}
        self._cond = threading.Condition()
        self._run: PodRun | None = None
        self._created_at = 0.0
        self._guard_config: bytes | None = None

    @classmethod
    def connect(cls, settings: BackendConfig) -> KubernetesBackend:
        return cls(settings, connect(settings))

    def require_image(self, ref: str) -> str:
        """The reference the nodes run (they hold or pull it; the record names it)."""
        return self.settings.image_ref(ref)

    def create(self, spec: ContainerSpec, *, independent: bool = False) -> RunContainer:
        role = spec.labels.get(LABEL_ROLE, "")
        if role == "mcp" and independent:
            role = manifests.mcp_container_name(spec)
        elif role not in (manifests.GUARD, manifests.STEP) or independent:
            raise ConfigError(
                f"a run's Pod holds a guard, a step and stdio servers, not a {role!r} container"
            )
        container = PodContainer(self, role, spec)
        with self._cond:
            if self._run is not None or role in self._specs:
                raise LaunchError(f"the run's Pod already exists; cannot add its {role}")
            self._specs[role] = container
            self._cond.notify_all()
        return container

    def connect_networks(self, container: RunContainer, networks: list[str]) -> None:
        if networks:
            raise ConfigError(
                "bridge.networks names Docker networks; on Kubernetes the guard reaches its "
                "upstream through the Pod network"
            )

    def node(self) -> str | None:
        return self._run.view.node_name if self._run is not None else None

    def id_map(self) -> IdMap:
        return NO_REMAP  # the Pod's uids are the node's (no user namespaces for Pods here)

    def require_step_runtime(self, runtime: StepRuntime) -> None:
        if runtime != "runc":
            raise ConfigError(POD_RUNSC_REFUSAL)

    def pod_age_s(self) -> float:
        return time.monotonic() - self._created_at

    def pod_run(self) -> PodRun:
        """The run's Pod, created at the first need once the guard's, the step's and
        every stdio server's specs are in (the step's is made beside the guard's start,
        the servers' beside both; the guard's config says how many servers there are)."""
        with self._cond:
            if self._run is not None:
                return self._run
            if not self._cond.wait_for(lambda: manifests.GUARD in self._specs, SPECS_DEADLINE_S):
                raise LaunchError("the run's guard was never described: no Pod was made")
            guard = self._specs[manifests.GUARD].spec
            # Taken once: another caller may wait here while the first waits below.
            if self._guard_config is None:
                self._guard_config = _take_guard_config(guard)
            config_json = self._guard_config
            wanted = {manifests.GUARD, manifests.STEP} | _server_roles(config_json)
            if not self._cond.wait_for(lambda: wanted <= set(self._specs), SPECS_DEADLINE_S):
                missing = sorted(wanted - set(self._specs))
                raise LaunchError(f"the run's {', '.join(missing)} never described: no Pod")
            if self._run is not None:  # made by another caller while this one waited
                return self._run
            if set(self._specs) != wanted:
                raise LaunchError(f"the run's Pod would hold unknown containers: {self._specs}")
            step = self._specs[manifests.STEP].spec
            servers = [
                c.spec for r, c in sorted(self._specs.items()) if r.startswith(manifests.MCP_PREFIX)
            ]
            mounts = [*guard.mounts, *step.mounts, *(m for s in servers for m in s.mounts)]
            files = frozenset(_file_sources(mounts))
            meta = manifests.RunMeta.of(guard, runner_host=socket.gethostname(), files=files)
            pod = manifests.pod_manifest(guard, step, self.settings, meta, servers)
            secret = manifests.secret_manifest(meta, self.settings, config_json)
            self._created_at = time.monotonic()
            with stopsignals.held():  # a stop lands once the run holds its Pod, not before
                self._run = PodRun.create(self.api, pod, secret)
            return self._run

    def remove_all(self) -> None:
        """The Pod and its Secret deleted; returns once the Pod is gone."""
        if self._run is not None:
            self._run.delete()

    def remove_ahead(self, container: RunContainer) -> None:
        """Never asked (`removes_each` is False): a Pod's containers go with the Pod."""
        raise TypeError("a Pod's containers are removed together, with the Pod")

    def close(self) -> None:
        for watch in self.exit_watches:
            watch.cancel()
            watch.join()
        if self._run is not None and self._run.watch is not None:
            self._run.watch.stop()
        with contextlib.suppress(Exception):
            self.api.close()


def _file_sources(mounts: list[Any]) -> set[str]:
    """Which host sources are files (a hostPath volume says File or Directory).

    Each is a path the runner made; one that is a link (or gone) is refused, never
    followed by the node."""
    files = set()
    for mount in mounts:
        try:
            st = os.lstat(mount.source)
        except OSError as exc:
            raise LaunchError(f"{mount.source}: {exc.strerror}") from None
        if stat.S_ISREG(st.st_mode):
            files.add(mount.source)
        elif not stat.S_ISDIR(st.st_mode):
            raise LaunchError(f"{mount.source} is neither a folder nor a file: not mounted")
    return files


def _server_roles(config_json: bytes) -> set[str]:
    """The containers of the stdio servers the guard's config names (by their uids)."""
    try:
        uids = json.loads(config_json).get("mcp_uids") or {}
    except (ValueError, AttributeError):
        raise LaunchError("the guard's config is not a JSON object") from None
    return {f"{manifests.MCP_PREFIX}{int(uid) - MCP_UID_BASE}" for uid in uids.values()}


def _take_guard_config(guard: ContainerSpec) -> bytes:
    """The config the run wrote for the guard, read and removed from the host: the
    Secret carries it to the guard instead (no link followed)."""
    (folder,) = [m.source for m in guard.mounts if m.target == DATA_DIR]
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(CONFIG_FILE_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(CONFIG_MAX_BYTES + 1)
        os.unlink(CONFIG_FILE_NAME, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    if len(data) > CONFIG_MAX_BYTES:
        raise LaunchError("the guard's config is too large for a Secret")
    return data
