"""What a container should be, as plain data the Docker layer turns into API calls.

Keeping the description pure (no `docker` import) lets the run logic and the
tests reason about mounts, users and limits without an engine, and lets another
backend (Kubernetes) consume the same description.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sandbox.contracts.defaults import empty_list


class Mount(BaseModel):
    model_config = ConfigDict(frozen=True)

    source: str
    target: str
    read_only: bool = True


class ContainerSpec(BaseModel):
    """One hardened container. Defaults are the safe ones; loosening is explicit."""

    name: str
    image: str
    command: list[str]
    entrypoint: list[str] | None = None  # None: the image's own
    user: str
    workdir: str = "/tmp"
    env: dict[str, str] = Field(default_factory=dict)
    mounts: list[Mount] = Field(default_factory=empty_list)
    tmpfs: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    memory_bytes: int = 1024 * 1024**2
    pids: int = 256
    cpus: float = 1.0
    seccomp_profile: str | None = None  # JSON text; None means the engine default
    runtime: str | None = None  # the engine's OCI runtime by name; None: its default (runc)
    network_mode: str = "none"
    cap_add: list[str] = Field(default_factory=empty_list)
    sysctls: dict[str, str] = Field(default_factory=dict)
    read_only_rootfs: bool = True
    init: bool = True  # docker-init as pid 1; off when the command reaps itself
    log_max_bytes: int = 8 * 1024**2
