"""Creating, watching and removing the run's containers through the Engine API.

Every container is labelled with its run, so `sandbox gc` can find what a
crashed runner left. The hardening that never varies (no capabilities,
no-new-privileges, read-only root, private cgroup namespace, capped logs) is
applied here; what varies per run comes in a `ContainerSpec`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import docker.errors
import requests
import urllib3
from docker import APIClient, DockerClient
from docker.models.containers import Container
from docker.types import CancellableStream, LogConfig
from docker.types import Mount as DockerMount
from docker.utils.socket import frames_iter

from sandbox import stopsignals
from sandbox.backends.docker import hostcgroup
from sandbox.contracts.errors import EngineError
from sandbox.contracts.names import LABEL_MANAGED
from sandbox.contracts.record import OutputTail, PeakMemorySource
from sandbox.contracts.spec import ContainerSpec

TAIL_CHARS = 8000


def create(client: DockerClient, spec: ContainerSpec) -> Container:
    """Create (not start) a hardened container from `spec`."""
    security_opt = ["no-new-privileges:true"]
    if spec.seccomp_profile is not None:
        security_opt.append("seccomp=" + spec.seccomp_profile)
    kwargs: dict[str, Any] = {
        "image": spec.image,
        "command": spec.command,
        "entrypoint": spec.entrypoint,
        "name": spec.name,
        "user": spec.user,
        "working_dir": spec.workdir,
        "environment": spec.env,
        "labels": {LABEL_MANAGED: "1", **spec.labels},
        "mounts": [
            DockerMount(target=m.target, source=m.source, type="bind", read_only=m.read_only)
            for m in spec.mounts
        ],
        "tmpfs": spec.tmpfs,
        "read_only": spec.read_only_rootfs,
        "cap_drop": ["ALL"],
        "cap_add": spec.cap_add or None,
        "security_opt": security_opt,
        "mem_limit": spec.memory_bytes,
        "memswap_limit": spec.memory_bytes,
        "pids_limit": spec.pids,
        "nano_cpus": int(spec.cpus * 1e9),
        "network_mode": spec.network_mode,
        "init": spec.init,
        "ipc_mode": "private",
        "cgroupns": "private",
        "log_config": LogConfig(
            type="json-file", config={"max-size": str(spec.log_max_bytes), "max-file": "1"}
        ),
        "detach": True,
        "stdin_open": False,
        "tty": False,
    }
    if spec.sysctls:
        kwargs["sysctls"] = spec.sysctls
    if spec.runtime is not None:
        kwargs["runtime"] = spec.runtime
    try:
        container = _create_masked(client, kwargs)
    except docker.errors.ImageNotFound:
        raise EngineError(f"image {spec.image} not found; run `make images`") from None
    except docker.errors.APIError as exc:
        raise EngineError(f"creating container {spec.name} failed: {exc.explanation}") from None
    return container


# The engine's default masked paths, plus what it leaves readable by default.
MASKED_PATHS = [
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/proc/kallsyms",
    "/proc/config.gz",
    "/proc/modules",
    "/sys/kernel/debug",
    "/sys/kernel/vmcoreinfo",
    "/sys/module",
]


def _create_masked(client: DockerClient, kwargs: dict[str, Any]) -> Container:
    """`containers.create`, plus HostConfig.MaskedPaths, which docker-py does not expose.

    (Mounting over /proc paths is refused by runc, so masking is the only way to
    close /proc/kallsyms and friends.)"""
    from docker.models.containers import _create_container_args  # type: ignore[attr-defined]

    args = _create_container_args({**kwargs, "version": client.api.api_version})
    args["host_config"]["MaskedPaths"] = MASKED_PATHS
    created = client.api.create_container(**args)
    # The model from what was asked (no inspect round trip before the start): its id, name
    # and user are the engine's as created; `state()` and the others read the engine anew.
    return client.containers.prepare_model(
        {
            "Id": created["Id"],
            "Name": "/" + str(kwargs["name"]),
            "Config": {"User": kwargs.get("user") or "", "Labels": kwargs.get("labels") or {}},
        }
    )


class OwnedContainers:
    """The containers one run created; all removed when the run ends, however it ends.

    A container is tracked in the same uninterruptible step that creates it, so an
    interrupted run never leaves an untracked one behind.
    """

    def __init__(self, client: DockerClient) -> None:
        self._client = client
        self._owned: list[Container] = []
        self._independent: list[Container] = []
        self._lock = threading.Lock()

    def create(self, spec: ContainerSpec, *, independent: bool = False) -> Container:
        """`independent`: shares nothing with the others (no namespace), so it may be
        removed at the same time as they are."""
        with stopsignals.held():
            container = create(self._client, spec)
            with self._lock:
                (self._independent if independent else self._owned).append(container)
        return container

    def remove_all(self) -> None:
        """Newest first (the step before the guard whose network it shares), independent
        ones beside them; a second signal during the clean-up waits until it is done."""
        with stopsignals.held():
            with self._lock:
                independent, self._independent = self._independent, []
            threads = [
                threading.Thread(target=remove, args=(c,), name="remove", daemon=True)
                for c in independent
            ]
            for thread in threads:
                thread.start()
            while self._owned:
                remove(self._owned[-1])
                self._owned.pop()
            for thread in threads:
                thread.join()

    def remove_one(self, container: Container) -> None:
        """Remove `container` now (one `remove_all` would remove later; it then skips
        it). Tracked until it is gone, so a failed removal is tried again there."""
        with stopsignals.held():
            remove(container)
            with self._lock:
                for owned in (self._owned, self._independent):
                    if container in owned:
                        owned.remove(container)

    def __enter__(self) -> OwnedContainers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove_all()


REMOVE_DEADLINE_S = 180.0
REMOVE_POLL_S = 0.2


def remove(container: Container) -> None:
    """Force-remove; a container already gone is fine, and so is an engine that is gone
    (the container is labelled: `sandbox gc` removes it once the engine is back).

    An engine too loaded to answer within the client's timeout is asked again (and a
    removal it already has in progress is waited for) until the container is gone or
    REMOVE_DEADLINE_S passed."""
    if container.client is not None:  # always, for a container the engine listed
        remove_id(container.client.api, str(container.id))


def remove_id(api: APIClient, container_id: str) -> bool:
    """`remove` by id, for callers that hold only the engine's listing (`sandbox gc`, where
    another runner or gc may be removing the same container at the same moment): True
    when the container is gone (removed here, by that other remover, or already)."""
    deadline = time.monotonic() + REMOVE_DEADLINE_S
    while True:
        try:
            api.remove_container(container_id, force=True, v=True)
            return True
        except docker.errors.NotFound:
            return True
        except docker.errors.APIError as exc:
            if exc.status_code != 409 or "in progress" not in str(exc):
                return False
        except requests.exceptions.ReadTimeout:
            pass
        except requests.exceptions.ConnectionError as exc:
            if not _is_read_timeout(exc):
                return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(REMOVE_POLL_S)


@dataclass
class Usage:
    """Peak memory and CPU seen while the container ran: the engine's sampled stats, and,
    when asked for, the container's memory cgroup read on the host (`hostcgroup`).

    `peak_memory_bytes` is the larger of the two; `peak_memory_source` names it."""

    peak_memory_bytes: int | None = None
    peak_memory_source: PeakMemorySource | None = None
    cpu_seconds: float | None = None
    stats_peak_bytes: int | None = None
    host_cgroup_peak_bytes: int | None = None
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _take(self, sample: dict[str, Any]) -> None:
        memory = sample.get("memory_stats") or {}
        # cgroup v1 reports the peak since start (max_usage); v2 only the current usage.
        peak = memory.get("max_usage") or memory.get("usage")
        if peak:
            with self._lock:
                self.stats_peak_bytes = max(self.stats_peak_bytes or 0, int(peak))
                self._settle()
        cpu = ((sample.get("cpu_stats") or {}).get("cpu_usage") or {}).get("total_usage")
        if cpu:
            self.cpu_seconds = max(self.cpu_seconds or 0.0, cpu / 1e9)

    def _take_host(self, peak: int) -> None:
        with self._lock:
            self.host_cgroup_peak_bytes = max(self.host_cgroup_peak_bytes or 0, peak)
            self._settle()

    def _settle(self) -> None:
        host, stats = self.host_cgroup_peak_bytes or 0, self.stats_peak_bytes or 0
        if host or stats:
            self.peak_memory_bytes = max(host, stats)
            self.peak_memory_source = "host_cgroup" if host >= stats else "engine_stats"

    def finish(self) -> None:
        """Stop sampling (see `finish_usage`)."""
        finish_usage(self)


SAMPLE_INTERVAL_S = 0.25
# The host's look at the cgroup's high-water mark: one pread of a small file.
HOST_LOOK_INTERVAL_S = 0.02


def watch_usage(container: Container, *, host_cgroup: bool = False) -> Usage:
    """Sample the engine's one-shot stats in a thread until `finish_usage`; with
    `host_cgroup`, also look at the container's memory cgroup on the host every
    HOST_LOOK_INTERVAL_S in a second thread (for a runtime that hides the cgroup
    from the executor; see `hostcgroup` for what that look guarantees).

    The first sample is taken one interval in, so a short step costs no engine call;
    its figures come from the executor's own report anyway. (The streaming stats
    endpoint of Docker 20.10 does not end when the container exits, so a stream
    would keep the collect phase waiting.)"""
    usage = Usage()

    def follow() -> None:
        while not usage._stop.wait(SAMPLE_INTERVAL_S):
            try:
                sample = container.stats(stream=False, one_shot=True)
            except Exception:
                return
            if isinstance(sample, dict) and not usage._stop.is_set():
                usage._take(sample)

    client, container_id = container.client, container.id

    def look() -> None:
        if client is None or container_id is None:
            return
        try:  # its own inspect: the run's Container object is not shared with this thread
            attrs = client.api.inspect_container(container_id)
            pid = int((attrs.get("State") or {}).get("Pid") or 0)
        except Exception:
            return
        reader = hostcgroup.PeakReader.open(pid) if pid > 0 else None
        if reader is None:
            return
        try:
            while True:
                peak = reader.read()
                if peak is None:
                    return  # the cgroup is gone with its container
                usage._take_host(peak)
                if usage._stop.wait(HOST_LOOK_INTERVAL_S):
                    return
        finally:
            reader.close()

    usage._thread = threading.Thread(target=follow, name="stats", daemon=True)
    usage._thread.start()
    if host_cgroup:
        threading.Thread(target=look, name="cgroup-peak", daemon=True).start()
    return usage


def finish_usage(usage: Usage) -> None:
    """Stop sampling. A stats call in flight is not waited for (the engine can take a
    few hundred ms to answer one); its late answer is dropped, and the thread ends
    when it returns."""
    usage._stop.set()


def _is_read_timeout(exc: requests.exceptions.ConnectionError) -> bool:
    """requests reports some read timeouts of a long call as a ConnectionError."""
    return "Read timed out" in str(exc) or any(
        isinstance(arg, urllib3.exceptions.ReadTimeoutError) for arg in exc.args
    )


def wait(container: Container, timeout_s: float) -> int | None:
    """The exit code, or None when the timeout passed first (container still running)."""
    try:
        result = container.wait(timeout=timeout_s)
    except requests.exceptions.ReadTimeout:
        return None
    except requests.exceptions.ConnectionError as exc:
        if _is_read_timeout(exc):
            return None
        raise EngineError(f"the Docker engine stopped answering during the run ({exc})") from None
    except docker.errors.NotFound:
        return None
    return int(result.get("StatusCode", -1))


class ExitWatch:
    """Calls back, from a thread, if a container stops before `cancel()`.

    The run kills its step when the guard dies: a step has no business running on
    without its guard (every call would fail, the action log could not be
    complete), and a guard that dies while starting would otherwise leave the
    step's executor waiting for it until its deadline."""

    POLL_S = 60.0  # one engine wait at a time; a long wait is re-issued

    def __init__(self, container: Container, on_exit: Callable[[], None]) -> None:
        self._container = container
        self._on_exit = on_exit
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="exit-watch", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._cancelled.is_set():
            try:
                code = wait(self._container, self.POLL_S)
            except Exception:  # the engine went away: the run's own wait will say so
                return
            if self._cancelled.is_set():
                return
            if code is not None or not is_running(self._container)[0]:
                self._on_exit()
                return

    def cancel(self) -> None:
        """No call back from now on (the runner is about to stop the container itself)."""
        self._cancelled.set()

    def join(self, timeout_s: float = 5.0) -> None:
        """Wait for the thread, which ends once the container is stopped or gone."""
        self._thread.join(timeout=timeout_s)


def kill(container: Container) -> None:
    """SIGKILL every process of the container (its pid namespace dies with it)."""
    with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
        container.kill()
    wait(container, timeout_s=30)


class _Tail:
    """The last TAIL_CHARS of a stream, fed chunk by chunk (a bounded buffer)."""

    def __init__(self) -> None:
        self._keep = bytearray()
        self._total = 0

    def feed(self, chunk: bytes) -> None:
        self._total += len(chunk)
        self._keep += chunk
        if len(self._keep) > TAIL_CHARS * 4:
            del self._keep[: len(self._keep) - TAIL_CHARS * 4]

    def tail(self) -> OutputTail:
        text = self._keep.decode("utf-8", errors="replace")
        truncated = self._total > len(self._keep) or len(text) > TAIL_CHARS
        return OutputTail(text=text[-TAIL_CHARS:], total_bytes=self._total, truncated=truncated)


STDOUT, STDERR = 1, 2  # the stream numbers of the engine's multiplexed output


def _read_exact(raw: Any, size: int) -> bytes:
    """`size` bytes of the response body, fewer only at its end."""
    out = b""
    while len(out) < size:
        chunk = raw.read(size - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _log_frames(container: Container) -> Iterator[tuple[int, bytes]]:
    """The container's output so far as the engine kept it: (stream, bytes) frames of
    stdout and stderr in one request. Every container here is made without a TTY, so
    the engine multiplexes (an 8-byte header per frame: the stream, then the size);
    docker-py's `logs()` would first inspect the container to ask, and takes one
    request per stream to keep them apart."""
    api: Any = container.client.api  # type: ignore[union-attr]  # private helpers: not in the stubs
    url = api._url("/containers/{0}/logs", container.id)
    params = {"stdout": 1, "stderr": 1, "timestamps": 0, "follow": 0, "tail": "all"}
    response = api._get(url, params=params, stream=True)
    try:
        api._raise_for_status(response)
        while True:
            header = _read_exact(response.raw, 8)
            if len(header) < 8:
                return
            size = int.from_bytes(header[4:8], "big")
            data = _read_exact(response.raw, size)
            yield header[0], data
            if len(data) < size:
                return
    finally:
        response.close()


def save_output(container: Container, fd: int, cap_bytes: int) -> tuple[int, bool]:
    """Write the container's output (stdout and stderr, as the engine kept it so far) to
    `fd`, at most `cap_bytes`; the bytes written and whether more was cut. A running
    container is not waited for."""
    written = 0
    try:
        for _, chunk in _log_frames(container):
            room = cap_bytes - written
            if len(chunk) > room:
                os.write(fd, chunk[:room])
                return cap_bytes, True
            os.write(fd, chunk)
            written += len(chunk)
    except (docker.errors.APIError, requests.exceptions.RequestException):
        pass
    return written, False


def output_tails(container: Container) -> tuple[OutputTail, OutputTail]:
    """The last TAIL_CHARS of stdout and of stderr (logs are capped on disk too), read
    in one request."""
    out, err = _Tail(), _Tail()
    try:
        for stream, chunk in _log_frames(container):
            (err if stream == STDERR else out).feed(chunk)
    except docker.errors.APIError:
        return OutputTail(), OutputTail()
    return out.tail(), err.tail()


def connect_networks(client: DockerClient, container: Container, networks: list[str]) -> None:
    """Attach an existing container to more networks (the guard's ways to its upstreams)."""
    for name in networks:
        try:
            client.networks.get(name).connect(container)
        except docker.errors.NotFound:
            raise EngineError(f"network {name!r} does not exist") from None
        except docker.errors.APIError as exc:
            raise EngineError(f"connecting to network {name!r} failed: {exc.explanation}") from None


def _attach(container: Container) -> CancellableStream[bytes]:
    """`container.attach(stdout=True, stderr=True, stream=True, logs=True)` without the
    inspect docker-py makes first to ask whether the container has a TTY (none here):
    one round trip less before the guard can start."""
    api: Any = container.client.api  # type: ignore[union-attr]  # private helpers: not in the stubs
    url = api._url("/containers/{0}/attach", container.id)
    response = api._post(
        url,
        headers={"Connection": "Upgrade", "Upgrade": "tcp"},
        params={"logs": 1, "stdout": 1, "stderr": 1, "stream": 1},
        stream=True,
    )
    return CancellableStream(api._read_from_socket(response, True, tty=False), response)


class OutputFollower:
    """A container's output lines (stdout and stderr) as they come, read by a thread.

    Attached before the container starts, so no line is missed; the runner waits on
    a line (the guard's "firewall in", "ready") instead of polling. Waiting ends at
    the line, at the container's end, or at the deadline, whichever comes first.
    """

    MAX_LINES = 2000

    def __init__(self, container: Container, deadline_s: float) -> None:
        self._container = container
        self._deadline_s = deadline_s
        self._deadline = 0.0
        self._lines: list[str] = []
        self._partial = b""
        self._ended = False
        self._changed = threading.Condition()
        self._stream: Any = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> OutputFollower:
        self._deadline = time.monotonic() + self._deadline_s
        try:
            self._stream = _attach(self._container)
        except docker.errors.APIError as exc:
            raise EngineError(f"cannot follow {self._container.name}: {exc.explanation}") from None
        self._thread = threading.Thread(target=self._read, name="output", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()  # shuts the socket down: the reader sees the end
        if self._thread is not None:
            self._thread.join(timeout=5)
        # docker-py's close() leaves the socket's file object open, and with it the fd
        # (until a garbage collection): close it, and the response, here.
        with contextlib.suppress(Exception):
            response = self._stream._response
            response.raw._fp.fp.close()
            response.close()

    def _read(self) -> None:
        try:
            for chunk in self._stream:
                with self._changed:
                    *complete, self._partial = (self._partial + chunk).split(b"\n")
                    self._lines += [ln.decode("utf-8", "replace") for ln in complete]
                    del self._lines[: -self.MAX_LINES]
                    self._changed.notify_all()
        except Exception:  # closed under us, or the engine went away: the output ended
            pass
        finally:
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def wait_for_line(self, line: str) -> bool:
        """True once `line` was printed; False when the output ended or time ran out first."""
        with self._changed:
            while line not in self._lines:
                remaining = self._deadline - time.monotonic()
                if self._ended or remaining <= 0:
                    return False
                self._changed.wait(remaining)
            return True

    def lines(self) -> list[str]:
        with self._changed:
            return list(self._lines)

    def tail(self, count: int = 3) -> str:
        last = [ln for ln in self.lines() if ln.strip()][-count:]
        return " | ".join(last) if last else "(no output)"


class OutputCounter:
    """A container's stdout and stderr counted byte for byte as they leave it.

    The engine keeps a container's log capped (`log_max_bytes`, one file): once a
    flood passed the cap, what the engine still has is its last part, and a count read
    from it says a few MB where the step wrote hundreds. So the step's output is
    attached to before the container starts, and a thread reads every frame the
    engine copies out of the container, adding up each stream's bytes and keeping
    only its tail (`_Tail`: bounded memory whatever the volume). The engine writes an
    attached stream before it lets the container write more, so nothing passes
    uncounted; a slow reader slows the step, never loses bytes."""

    END_DEADLINE_S = 60.0  # after the container stopped: the rest of its output

    def __init__(self, container: Container) -> None:
        api: Any = container.client.api  # type: ignore[union-attr]  # private helpers: not in the stubs
        url = api._url("/containers/{0}/attach", container.id)
        self._response = api._post(
            url,
            headers={"Connection": "Upgrade", "Upgrade": "tcp"},
            params={"logs": 0, "stdout": 1, "stderr": 1, "stream": 1},
            stream=True,
        )
        api._raise_for_status(self._response)
        self._socket = api._get_raw_response_socket(self._response)
        api._disable_socket_timeout(self._socket)  # a step may be silent for long
        self._out, self._err = _Tail(), _Tail()
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._read, name="output-count", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for stream, chunk in frames_iter(self._socket, tty=False):  # type: ignore[no-untyped-call]
                (self._err if stream == STDERR else self._out).feed(chunk)
        except Exception:  # closed under us, or the engine went away: counted so far
            pass
        finally:
            self._ended.set()

    def tails(self) -> tuple[OutputTail, OutputTail]:
        """Call once the container stopped: the tails with exact totals (if the engine
        did not end the stream in time, what was counted, marked cut)."""
        ended = self._ended.wait(self.END_DEADLINE_S)
        self.close()
        out, err = self._out.tail(), self._err.tail()
        if not ended:
            out.truncated = err.truncated = True
        return out, err

    def close(self) -> None:
        # The SDK ties the response and its socket in a reference cycle (it sets
        # `_response` on the socket), so the connection would stay open until the cycle
        # collector ran: its socket is closed here, once the reader is done with it.
        sock = getattr(self._socket, "_sock", None)
        with contextlib.suppress(Exception):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self._response.raw._fp.fp.close()
            self._response.close()
        if sock is not None:
            with contextlib.suppress(Exception):
                sock.close()


def run_once(client: DockerClient, spec: ContainerSpec, timeout_s: float) -> tuple[int | None, str]:
    """Run a short-lived container to its end; its exit code (None on timeout) and output."""
    with OwnedContainers(client) as owned:
        container = owned.create(spec)
        container.start()
        code = wait(container, timeout_s)
        if code is None:
            kill(container)
        output = container.logs(stdout=True, stderr=True).decode("utf-8", errors="replace")
        return code, output


def is_running(container: Container) -> tuple[bool, int | None]:
    """Whether the container still runs, and its exit code when it does not."""
    try:
        container.reload()
    except docker.errors.NotFound:
        return False, None
    state = container.attrs.get("State") or {}
    return bool(state.get("Running")), state.get("ExitCode")


def oom_killed(container: Container) -> bool:
    """Whether the kernel's OOM killer hit the container (the engine's State.OOMKilled)."""
    try:
        container.reload()
    except docker.errors.NotFound:
        return False
    return bool((container.attrs.get("State") or {}).get("OOMKilled"))


def stop(container: Container, grace_s: int = 5) -> None:
    """SIGTERM, then SIGKILL after the grace period; gone is fine."""
    with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
        container.stop(timeout=grace_s)
