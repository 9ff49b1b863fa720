"""What a second engine is, as data, and the host's engine it must leave working: the
engine's configuration and saved state (`EngineConfig`, `EngineState`), its id
mappings, the images a test run needs in it (`RUN_IMAGES`), runsc's install, and the
check that the host's engine still runs a container on its default network
(`check_main_engine`). `second_engine.py` starts
and stops engines from these."""

from __future__ import annotations

import io
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import docker
import docker.errors
from docker import DockerClient
from pydantic import BaseModel

from sandbox.contracts import names as images
from testbed import paths
from testbed.engines.hoststate import Proc

ENSURE_RUNSC = paths.REPO / "scripts" / "ensure-runsc.sh"
MAIN_HOST = "unix:///var/run/docker.sock"
PROBE_PROGRAMS = ("/usr/bin/sleep", "/usr/bin/true", "/usr/bin/cat", "/usr/bin/id")
# What a test run needs in the engine: the step, the guard and the MCP server images.
RUN_IMAGES = (images.STEP_IMAGE, images.GUARD_IMAGE, images.MCP_IMAGE)


class EngineError(RuntimeError):
    """The second engine did not start, or did not stop cleanly (the message says what)."""


class MainEngineBroken(EngineError):
    """The host's engine no longer runs a container on its default network."""


class Runtime(BaseModel, frozen=True):
    """An OCI runtime registered in the engine: gVisor's runsc with these arguments."""

    args: tuple[str, ...] = ()


class EngineConfig(BaseModel, frozen=True):
    """What differs between second engines; one engine per distinct config in a pool."""

    name: str
    runtimes: dict[str, Runtime] = {}
    userns_remap: bool = False
    daemon_options: dict[str, Any] = {}

    @classmethod
    def plain(cls) -> EngineConfig:
        return cls(name="plain")

    @classmethod
    def runsc(cls) -> EngineConfig:
        """`runsc` as the run needs it (passthrough network, the OCI seccomp profile
        applied: sandbox.launch.runtime); the default netstack (fails at start on
        kernels from about 6.11), passthrough alone, and passthrough with seccomp
        under their own names."""
        return cls(
            name="runsc",
            runtimes={
                "runsc": Runtime(args=("--network=host", "--oci-seccomp")),
                "runsc-netstack": Runtime(),
                "runsc-host": Runtime(args=("--network=host",)),
                "runsc-host-sc": Runtime(args=("--network=host", "--oci-seccomp")),
            },
        )

    @classmethod
    def userns(cls) -> EngineConfig:
        return cls(name="userns", userns_remap=True)

    def key(self) -> str:
        return self.model_dump_json()


class IdRange(BaseModel):
    """One contiguous id mapping: container id `inside + k` is host id `outside + k`."""

    inside: int
    outside: int
    count: int

    def host_id(self, container_id: int) -> int:
        if not self.inside <= container_id < self.inside + self.count:
            raise ValueError(f"id {container_id} is outside the mapping {self}")
        return self.outside + container_id - self.inside


class EngineState(BaseModel):
    """Everything stop() needs, in the engine's folder (so a later session can stop it)."""

    id: str
    directory: Path
    config: EngineConfig
    owner: Proc | None  # None: started by `up`, lives until `down`
    dockerd: Proc | None = None
    namespaces: list[str] = []
    cgroup_parent: str
    containerd_namespace: str
    shares: list[str] = []
    created_run_containerd: bool = False
    remap: IdRange | None = None
    main_host: str
    main_had_docker0: bool

    @property
    def socket(self) -> Path:
        return self.directory / "engine.sock"


def ensure_runsc() -> Path:
    """runsc's path, installing the Debian package first when it is missing."""
    proc = subprocess.run(
        ["bash", str(ENSURE_RUNSC)], stdout=subprocess.PIPE, text=True, check=False
    )
    if proc.returncode != 0:
        raise EngineError(f"{ENSURE_RUNSC.name} failed (exit {proc.returncode}); see its stderr")
    return Path(proc.stdout.strip().splitlines()[-1])


def read_remap(info: dict[str, Any]) -> tuple[int, int] | None:
    """(uid, gid) of the container's root on the host, from `docker info`; None if the
    engine does not remap. `SecurityOptions` lists `name=userns` when it does, and its
    `DockerRootDir` then ends in `<uid>.<gid>` (the remapped root's own image store).
    The size of the range is not in `docker info`: `uid_map` of a container is."""
    if not any("name=userns" in opt for opt in info.get("SecurityOptions") or ()):
        return None
    match = re.fullmatch(r"(\d+)\.(\d+)", Path(info["DockerRootDir"]).name)
    if match is None:
        raise EngineError(f"userns on but DockerRootDir is {info['DockerRootDir']!r}")
    return int(match[1]), int(match[2])


def id_map(pid: int, kind: str = "uid") -> list[IdRange]:
    """The uid_map (or gid_map) of a host process: the truth for a running container."""
    rows = Path(f"/proc/{pid}/{kind}_map").read_text().split("\n")
    return [
        IdRange(inside=int(a), outside=int(b), count=int(c))
        for a, b, c in (row.split() for row in rows if row.strip())
    ]


def check_main_engine(main_host: str = MAIN_HOST, *, had_docker0: bool = True) -> None:
    """The host's engine runs `sandbox-step:<tag> true` on its default network, or raise."""
    if had_docker0 and not Path("/sys/class/net/docker0").exists():
        raise MainEngineBroken("the host's docker0 bridge is gone")
    try:
        client = DockerClient(base_url=main_host, timeout=120)
        try:
            client.containers.run(
                images.STEP_IMAGE,
                ["true"],
                remove=True,
                network_mode="bridge" if had_docker0 else "none",
                labels={"sandbox.test-engine-check": "1"},
            )
        finally:
            client.close()
    except docker.errors.DockerException as exc:
        raise MainEngineBroken(
            f"the host's engine ({main_host}) no longer runs a container on its default "
            f"network: {exc}"
        ) from exc


def probe_rootfs() -> bytes:
    """A tar of a few host programs and the libraries `ldd` names: a 3 MB image that
    loads in well under a second, for tests of the engine itself."""
    files: set[str] = set(PROBE_PROGRAMS)
    for program in PROBE_PROGRAMS:
        out = subprocess.run(["ldd", program], capture_output=True, text=True, check=True).stdout
        files.update(tok for tok in out.split() if tok.startswith("/"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("tmp", "proc", "sys", "dev", "etc"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if name == "tmp" else 0o755
            tar.addfile(info)
        for path in sorted(files):
            data = Path(path).read_bytes()  # links resolved: the image has plain files
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
