"""A private second Docker engine for the tests and the bench: its own dockerd, started
and stopped by pid.

    with SecondEngine.start(EngineConfig.runsc(), images=(images.STEP_IMAGE,)) as engine:
        engine.client.containers.run(..., runtime="runsc-host-sc")   # docker.DockerClient
        subprocess.run([...], env=engine.env())                     # DOCKER_HOST=engine.url

Several tests share one engine per configuration through `EnginePool` (the session
fixtures in `tests/engines/fixtures.py`). For humans:
`python -m testbed.engines.second_engine status|sweep|up|down|measure`.

Guarantees, and how:
- The host's dockerd is never signalled, restarted or reconfigured. The engine has its
  own config file, socket, data-root, exec-root, pidfile, key file, cgroup parent and
  containerd namespaces, all in one folder under `ENGINES_DIR`, and its own containerd
  (a private tmpfs on /run/containerd hides any system one).
- No host network change. `"bridge": "none"`, no iptables, no forwarding or masquerade,
  and the daemon lives in its own network namespace: networks it creates (and a
  container that gets "the host's" network) are in there, never beside `docker0`,
  and the host's FORWARD policy never sees them. `netns()` enters it to reach a
  container address from the test.
- No host mount change that outlives the engine. The daemon has its own mount
  namespace, a slave of the host's: everything it mounts stays there and goes with it.
  The host's own mounts are private, so the folders named in `share` (and the
  engine's `workdir`) are bound onto themselves as shared mounts, for as long as an
  engine uses them: what a runner mounts there (a run's disk and view) reaches the
  daemon, and so does the unmount. The namespace drops its copies of everything else
  that is not system layout (other programs' run disks, overlays, netns files), so it
  never keeps them alive.
- userns-remap without touching /etc: the remap user is `nobody:nogroup`, and its
  subordinate ranges come from the engine's own subuid/subgid files, bind-mounted over
  /etc/subuid and /etc/subgid inside the daemon's mount namespace only. dockerd reads
  them at start; its containerd, shims and runc inherit the namespace (runc writes the
  maps itself and never reads the files). The host files are never written, so a killed
  session leaves them as they were.
- Stop: remove the engine's containers, SIGTERM dockerd (SIGKILL after a deadline), kill
  what is left in its cgroup parent (frozen first) and its containerd and shims (by
  namespace and folder), release its shares, remove its cgroups and its folder, then
  run a container on the host's engine's default network: `MainEngineBroken` if that
  (or `docker0`) is gone.
- A killed session: dockerd has a parent-death signal (SIGTERM), and `sweep()` (run at
  the start of each session) stops every engine whose owner no longer holds its lock.

Limits: the engine needs root. Image loads cost what `docker save | docker load`
costs (seconds per image; see README.md). Only Docker 20.10 (Debian bookworm's
docker.io) was tried.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import docker
import docker.errors
from docker import DockerClient

from sandbox.contracts import names as images
from testbed.engines import hoststate
from testbed.engines.engine_config import (
    MAIN_HOST,
    EngineConfig,
    EngineError,
    EngineState,
    IdRange,
    check_main_engine,
    ensure_runsc,
    probe_rootfs,
    read_remap,
)
from testbed.engines.hoststate import Proc
from testbed.paths import REPO

REPO_ROOT = REPO
ENTER = Path(__file__).resolve().parent / "enter.py"
ENGINES_DIR = Path(os.environ.get("SANDBOX_TEST_ENGINES_DIR", "/var/tmp/sandbox-test-engines"))
PROBE_IMAGE = f"sandbox-engine-probe:{images.IMAGE_TAG}"
REMAP_USER, REMAP_GROUP, REMAP_SIZE = "nobody", "nogroup", 65536
DAEMON_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENGINE_BINARIES = (
    "dockerd",
    "containerd",
    "containerd-shim-runc-v2",
    "runc",
    "docker-init",
    "docker-proxy",
)
UNIX_PATH_MAX = 107
CLONE_NEWNET = 0x40000000
# What start() sets for isolation: a caller's `daemon_options` may not override these.
RESERVED = {
    "data-root",
    "exec-root",
    "pidfile",
    "hosts",
    "bridge",
    "iptables",
    "ip6tables",
    "ip-forward",
    "ip-masq",
    "cgroup-parent",
    "containerd",
    "containerd-namespace",
    "containerd-plugins-namespace",
    "deprecated-key-path",
    "userns-remap",
    "runtimes",
}
_libc = ctypes.CDLL(None, use_errno=True)


def _lock(path: Path, *, block: bool = True) -> int | None:
    """An exclusive flock on `path` (created), or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def _engines_lock() -> Iterator[None]:
    """Serialises share set-up and tear-down, and sweeps, across sessions."""
    fd = _lock(ENGINES_DIR / ".lock")
    assert fd is not None
    try:
        yield
    finally:
        os.close(fd)


def _shares_registry() -> dict[str, int]:
    """Shared self-binds made by engines: path -> mount id (held under the lock)."""
    path = ENGINES_DIR / "shares.json"
    data: dict[str, int] = json.loads(path.read_text()) if path.exists() else {}
    return data


def _save_shares_registry(data: dict[str, int]) -> None:
    path = ENGINES_DIR / "shares.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _states(exclude: Path | None = None) -> list[EngineState]:
    out = []
    for state_file in sorted(ENGINES_DIR.glob("*/state.json")):
        if exclude is not None and state_file.parent == exclude:
            continue
        with contextlib.suppress(OSError, ValueError):
            out.append(EngineState.model_validate_json(state_file.read_text()))
    return out


def _in_use(state: EngineState) -> bool:
    """Whether an engine is still there for its shares (running, or still starting)."""
    if state.dockerd is not None:
        return state.dockerd.alive()
    return state.owner is not None and state.owner.alive()


class SecondEngine:
    """One running second engine; see the module docstring for what it guarantees."""

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.timings: dict[str, float] = {}
        self._client: DockerClient | None = None
        self._netns_fd: int | None = None
        self._owner_lock: int | None = None

    # ---- what a test uses ---------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self.state.directory

    @property
    def url(self) -> str:
        """`unix://...` for DOCKER_HOST or `docker -H`."""
        return f"unix://{self.state.socket}"

    @property
    def workdir(self) -> Path:
        """A folder whose later mounts the daemon sees (put run folders here or in a share)."""
        return self.directory / "work"

    @property
    def pid(self) -> int:
        assert self.state.dockerd is not None
        return self.state.dockerd.pid

    @property
    def remap(self) -> IdRange | None:
        return self.state.remap

    @property
    def client(self) -> DockerClient:
        if self._client is None:
            self._client = DockerClient(base_url=self.url, timeout=120)
        return self._client

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for a subprocess (a `sandbox run`) aimed at this engine."""
        return {**(os.environ if base is None else base), "DOCKER_HOST": self.url}

    @contextlib.contextmanager
    def netns(self) -> Iterator[None]:
        """The calling thread in the daemon's network namespace (to reach a container's
        address on one of the engine's networks), and back."""
        assert self._netns_fd is not None
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(self._netns_fd)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(own)

    def load_images(self, *refs: str, deadline_s: float = 900) -> float:
        """`docker save refs | docker load` from the host's engine, skipping an image the
        engine already has with the same id; returns the seconds it took."""
        main = DockerClient(base_url=self.state.main_host, timeout=120)
        try:
            missing = []
            for ref in refs:
                want = main.images.get(ref).id
                with contextlib.suppress(docker.errors.ImageNotFound):
                    if self.client.images.get(ref).id == want:
                        continue
                missing.append(ref)
        finally:
            main.close()
        if not missing:
            return 0.0
        began = time.monotonic()
        save = subprocess.Popen(
            ["docker", "-H", self.state.main_host, "save", *missing],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        load = subprocess.run(
            ["docker", "-H", self.url, "load", "-q"],
            stdin=save.stdout,
            capture_output=True,
            text=True,
            timeout=deadline_s,
            check=False,
        )
        assert save.stdout is not None and save.stderr is not None
        save.stdout.close()
        save_err = save.stderr.read().decode(errors="replace")
        save_rc = save.wait(timeout=60)
        if save_rc != 0 or load.returncode != 0:
            raise EngineError(f"loading {missing} failed: {save_err.strip()} {load.stderr.strip()}")
        spent = time.monotonic() - began
        self.timings["images_s"] = self.timings.get("images_s", 0.0) + spent
        return spent

    def load_probe_image(self) -> str:
        """The tiny probe image (sleep, true, cat, id) in this engine; its reference."""
        with contextlib.suppress(docker.errors.ImageNotFound):
            self.client.images.get(PROBE_IMAGE)
            return PROBE_IMAGE
        repo, tag = PROBE_IMAGE.rsplit(":", 1)
        self.client.api.import_image_from_data(probe_rootfs(), repository=repo, tag=tag)
        return PROBE_IMAGE

    # ---- start ----------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        *,
        images: Iterable[str] = (),
        share: Iterable[Path] = (),
        detached: bool = False,
        deadline_s: float = 60,
    ) -> SecondEngine:
        """A running engine with `images` loaded. `share`: folders (besides `workdir`)
        in which mounts made on the host later must reach the daemon (a test session's
        base temp folder). `detached`: no owner (for `up`; `down` stops it)."""
        if os.geteuid() != 0:
            raise EngineError("a second engine needs root")
        bad = RESERVED & set(config.daemon_options)
        if bad:
            raise EngineError(f"daemon_options may not set {sorted(bad)}")
        ENGINES_DIR.mkdir(mode=0o711, parents=True, exist_ok=True)
        ENGINES_DIR.chmod(0o711)
        engine_id = secrets.token_hex(5)
        directory = ENGINES_DIR / engine_id
        if len(str(directory / "engine.sock")) > UNIX_PATH_MAX:
            raise EngineError(f"socket path too long under {ENGINES_DIR}")
        directory.mkdir(mode=0o711)
        directory.chmod(0o711)  # a remapped root must be able to pass through it
        state = EngineState(
            id=engine_id,
            directory=directory,
            config=config,
            owner=None if detached else Proc.of(os.getpid()),
            cgroup_parent=f"/sandbox-test-engine-{engine_id}",
            containerd_namespace=f"sandbox-test-{engine_id}",
            main_host=os.environ.get("DOCKER_HOST", MAIN_HOST),
            main_had_docker0=Path("/sys/class/net/docker0").exists(),
        )
        engine = cls(state)
        if not detached:
            engine._owner_lock = _lock(directory / "owner.lock")
        engine._save()
        try:
            began = time.monotonic()
            engine._start(share=[Path(p).resolve() for p in share], deadline_s=deadline_s)
            engine.timings["start_s"] = time.monotonic() - began
            engine.load_images(*images)
        except BaseException:
            with contextlib.suppress(EngineError):
                engine.stop(check_main=False)
            raise
        return engine

    def _save(self) -> None:
        path = self.directory / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.state.model_dump_json(indent=1))
        tmp.replace(path)

    def _daemon_config(self) -> dict[str, Any]:
        s, d = self.state, self.directory
        cfg: dict[str, Any] = {
            **s.config.daemon_options,
            "data-root": str(d / "data"),
            "exec-root": str(d / "exec"),
            "pidfile": str(d / "docker.pid"),
            "hosts": [self.url],
            "bridge": "none",
            "iptables": False,
            "ip-forward": False,
            "ip-masq": False,
            "cgroup-parent": s.cgroup_parent,
            "containerd-namespace": s.containerd_namespace,
            "containerd-plugins-namespace": f"{s.containerd_namespace}-plugins",
            "shutdown-timeout": 5,
            "live-restore": False,
        }
        if _dockerd_major() < 23:  # 20.10 keeps an identity key; not the host's
            cfg["deprecated-key-path"] = str(d / "key.json")
        if s.config.runtimes:
            runsc = str(ensure_runsc())
            cfg["runtimes"] = {
                name: {"path": runsc, **({"runtimeArgs": list(rt.args)} if rt.args else {})}
                for name, rt in s.config.runtimes.items()
            }
        if s.config.userns_remap:
            cfg["userns-remap"] = f"{REMAP_USER}:{REMAP_GROUP}"
        return cfg

    def _start(self, *, share: list[Path], deadline_s: float) -> None:
        s, d = self.state, self.directory
        for sub in ("data", "exec"):
            (d / sub).mkdir(mode=0o711)
        self.workdir.mkdir(mode=0o755)
        binds: list[tuple[str, str]] = []
        if s.config.userns_remap:
            # A random 64 Ki-aligned range far above any real user (16 Mi .. 2 Gi).
            base = REMAP_SIZE * (256 + secrets.randbelow(32768 - 257))
            for kind in ("subuid", "subgid"):
                private = d / kind
                private.write_text(f"{REMAP_USER}:{base}:{REMAP_SIZE}\n")
                private.chmod(0o644)
                binds.append((str(private), f"/etc/{kind}"))
            s.remap = IdRange(inside=0, outside=base, count=REMAP_SIZE)
        run_containerd = Path("/run/containerd")
        if not run_containerd.exists():
            run_containerd.mkdir(mode=0o711)
            s.created_run_containerd = True
        config_file = d / "daemon.json"
        config_file.write_text(json.dumps(self._daemon_config(), indent=1))
        with _engines_lock():
            self._share([self.workdir, *share])
        binaries = [shutil.which(b, path=DAEMON_PATH) for b in ENGINE_BINARIES]
        if binaries[0] is None:
            raise EngineError("dockerd is not installed (make engine installs docker.io)")
        needed = [str(d), *s.shares, "/run/containerd", "/etc/subuid", "/etc/subgid"]
        needed += [str(Path(b).resolve().parent) for b in binaries if b is not None]
        spec = {
            "pdeathsig_parent": None if s.owner is None else os.getpid(),
            "needed_paths": needed,
            "shares": s.shares,
            "binds": binds,
            "argv": [binaries[0], "--config-file", str(config_file)],
            "env": {"PATH": DAEMON_PATH, "LANG": "C.UTF-8"},
        }
        log = d / "dockerd.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-I", str(ENTER), json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # a ^C to the session reaches pytest, not dockerd
            )
        s.dockerd = Proc.of(proc.pid)
        self._save()
        end = time.monotonic() + deadline_s
        while True:
            if proc.poll() is not None:
                raise EngineError(f"dockerd exited ({proc.returncode}):\n{_tail(log)}")
            with contextlib.suppress(docker.errors.DockerException, OSError):
                if s.socket.exists() and self.client.ping():
                    break
            if time.monotonic() >= end:
                raise EngineError(
                    f"dockerd did not answer within {deadline_s:.0f} s:\n{_tail(log)}"
                )
            time.sleep(0.05)
        ours = [hoststate.ns_id(os.getpid(), k) for k in ("mnt", "net")]
        s.namespaces = [hoststate.ns_id(proc.pid, k) for k in ("mnt", "net")]
        if set(s.namespaces) & set(ours):
            raise EngineError("dockerd is not in its own namespaces")
        self._save()
        self._netns_fd = os.open(f"/proc/{proc.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        if s.remap is not None:
            seen = read_remap(self.client.info())
            if seen != (s.remap.outside, s.remap.outside):
                raise EngineError(f"the engine reports remap {seen}, not {s.remap.outside}")

    def _share(self, paths: list[Path]) -> None:
        """Make each folder a shared mount (reusing one another engine made); under the lock."""
        registry = _shares_registry()
        for path in paths:
            top = hoststate.top_mount(path)
            if top is None:
                registry[str(path)] = hoststate.bind_shared(path)
            elif not top.shared:
                raise EngineError(f"{path} is a mount point that is not shared; not changing it")
            self.state.shares.append(str(path))
            _save_shares_registry(registry)
            self._save()

    # ---- stop -----------------------------------------------------------------------

    def __enter__(self) -> SecondEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @classmethod
    def attach(cls, directory: Path) -> SecondEngine:
        """The engine whose `state.json` is in `directory` (running, half-started or dead)."""
        return cls(EngineState.model_validate_json((directory / "state.json").read_text()))

    def stop(self, *, check_main: bool = True) -> None:
        """Stop the engine and remove everything it made; EngineError naming what could
        not be removed, MainEngineBroken if the host's engine fails its check after."""
        s = self.state
        problems: list[str] = []
        if s.dockerd is not None and s.dockerd.alive():
            with contextlib.suppress(docker.errors.DockerException, OSError):
                for container in self.client.containers.list(all=True):
                    container.remove(force=True)
        if self._client is not None:
            self._client.close()
            self._client = None
        if s.dockerd is not None:
            hoststate.terminate([s.dockerd], deadline_s=30)
        try:
            hoststate.kill_cgroup_tree(s.cgroup_parent)
            if s.namespaces:
                for pid in hoststate.members(s.namespaces, str(s.directory)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                hoststate.wait_for(
                    "the engine's containerd and shims to exit",
                    lambda: not hoststate.members(s.namespaces, str(s.directory)),
                    15,
                )
        except TimeoutError as exc:
            problems.append(str(exc))
        if self._netns_fd is not None:
            os.close(self._netns_fd)
            self._netns_fd = None
        with _engines_lock():
            problems += self._unshare()
        left = hoststate.detach_all_under(s.directory)
        if left:
            problems.append(f"mounts left under the engine folder (detached): {left}")
        problems += hoststate.remove_cgroup_tree(s.cgroup_parent)
        if s.created_run_containerd:
            with contextlib.suppress(OSError):
                Path("/run/containerd").rmdir()
        if not hoststate.mounts_under(s.directory):
            shutil.rmtree(s.directory, ignore_errors=True)
        if self._owner_lock is not None:
            os.close(self._owner_lock)
            self._owner_lock = None
        if problems:
            raise EngineError(f"engine {s.id} did not stop cleanly: " + "; ".join(problems))
        if check_main:
            check_main_engine(s.main_host, had_docker0=s.main_had_docker0)

    def _unshare(self) -> list[str]:
        """Undo the shared self-binds no other engine still uses; under the lock."""
        registry = _shares_registry()
        users = {
            p for other in _states(exclude=self.directory) if _in_use(other) for p in other.shares
        }
        problems = []
        for path in self.state.shares:
            if path in users or path not in registry:
                continue
            error = hoststate.unmount_exact(Path(path), registry[path])
            if error is not None:
                problems.append(f"shared folder {error}")
                continue
            del registry[path]
        _save_shares_registry(registry)
        return problems


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _tail(log: Path, lines: int = 30) -> str:
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _dockerd_major() -> int:
    out = subprocess.run(["dockerd", "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"version (\d+)\.", out.stdout)
    return int(match[1]) if match else 0


def sweep() -> list[Path]:
    """Stop every engine whose owner is gone (its lock is free) or whose detached dockerd
    died; remove folders that never got a state. Returns the folders it cleaned."""
    cleaned: list[Path] = []
    if not ENGINES_DIR.is_dir():
        return cleaned
    for directory in sorted(p for p in ENGINES_DIR.iterdir() if p.is_dir()):
        try:
            if not (directory / "state.json").exists():
                # Killed between mkdir and the first save (a few microseconds): nothing ran.
                if time.time() - directory.stat().st_mtime > 600 and not hoststate.mounts_under(
                    directory
                ):
                    shutil.rmtree(directory, ignore_errors=True)
                    cleaned.append(directory)
                continue
            lock = _lock(directory / "owner.lock", block=False)
        except FileNotFoundError:
            continue  # its own session removed it after the listing: nothing to sweep
        if lock is None:
            continue  # its session is alive
        try:
            engine = SecondEngine.attach(directory)
            dockerd = engine.state.dockerd
            if engine.state.owner is None and dockerd is not None and dockerd.alive():
                continue  # started by `up`: `down` stops it
            engine.stop(check_main=False)
            cleaned.append(directory)
        finally:
            os.close(lock)
    if cleaned:
        check_main_engine()
    return cleaned


class EnginePool:
    """One engine per configuration, started when first asked for, all stopped by close()."""

    def __init__(self, share: Iterable[Path] = ()) -> None:
        self._share = tuple(share)
        self._engines: dict[str, SecondEngine] = {}

    def get(self, config: EngineConfig, images: Iterable[str] = ()) -> SecondEngine:
        engine = self._engines.get(config.key())
        if engine is None:
            engine = SecondEngine.start(config, share=self._share)
            self._engines[config.key()] = engine
        engine.load_images(*images)
        return engine

    @property
    def engines(self) -> list[SecondEngine]:
        return list(self._engines.values())

    def close(self) -> None:
        errors = []
        for engine in self._engines.values():
            try:
                engine.stop(check_main=False)
            except EngineError as exc:
                errors.append(str(exc))
        main_host = next((e.state.main_host for e in self._engines.values()), MAIN_HOST)
        had_docker0 = all(e.state.main_had_docker0 for e in self._engines.values())
        self._engines.clear()
        if errors:
            raise EngineError("; ".join(errors))
        check_main_engine(main_host, had_docker0=had_docker0)


def _measure(config: EngineConfig, refs: tuple[str, ...]) -> dict[str, Any]:
    began = time.monotonic()
    engine = SecondEngine.start(config)
    try:
        started = time.monotonic() - began
        loaded = engine.load_images(*refs)
    finally:
        stop_began = time.monotonic()
        engine.stop()
    return {
        "config": config.name,
        "start_s": round(started, 2),
        "images_s": round(loaded, 2),
        "stop_and_check_s": round(time.monotonic() - stop_began, 2),
    }


def main(argv: list[str] | None = None) -> int:
    configs = {
        c.name: c for c in (EngineConfig.plain(), EngineConfig.runsc(), EngineConfig.userns())
    }
    parser = argparse.ArgumentParser(prog="python -m testbed.engines.second_engine")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="list the engines on this host")
    sub.add_parser("sweep", help="stop engines whose session is gone")
    up = sub.add_parser("up", help="start an engine and leave it running")
    up.add_argument("config", choices=sorted(configs))
    up.add_argument("--image", action="append", default=[])
    down = sub.add_parser("down", help="stop one engine")
    down.add_argument("directory", type=Path)
    measure = sub.add_parser("measure", help="time start, image load and stop per config")
    measure.add_argument("config", nargs="*", default=sorted(configs))
    measure.add_argument(
        "--image", action="append", default=None, help="default: step, guard and MCP images"
    )
    args = parser.parse_args(argv)
    if args.command == "status":
        for state in _states():
            alive = state.dockerd is not None and state.dockerd.alive()
            print(f"{state.directory} {state.config.name} dockerd={'up' if alive else 'down'}")
    elif args.command == "sweep":
        for directory in sweep():
            print(f"stopped {directory}")
    elif args.command == "up":
        engine = SecondEngine.start(configs[args.config], images=args.image, detached=True)
        print(f"export DOCKER_HOST={engine.url}")
        print(f"# stop: python -m testbed.engines.second_engine down {engine.directory}")
    elif args.command == "down":
        SecondEngine.attach(args.directory).stop()
    else:
        refs = tuple(args.image or (images.STEP_IMAGE, images.GUARD_IMAGE, images.MCP_IMAGE))
        for name in args.config:
            print(json.dumps(_measure(configs[name], refs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
