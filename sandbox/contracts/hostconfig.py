"""The build host's own settings: which engine runs a test run's containers, and where.

A workflow's `workflow.toml` says what a step may do; this file says where this host
runs steps. It is the host's (root's), never the workflow's: a workflow cannot pick
its own engine, cluster or storage. Read from `--host-config PATH`, else
`$SANDBOX_HOST_CONFIG`, else `/etc/sandbox/host.toml` when it exists; without any,
the Docker engine on this host runs everything.

```toml
durability = "per-call"          # or "group" (the default): see the action log's contract

[backend]
kind = "kubernetes"              # or "docker" (the default)
kubeconfig = "/etc/sandbox/kubeconfig"
namespace = "sandbox-runs"
node_selector = { "sandbox.io/runner" = "true" }
storage = "hostPath"             # or "pvc" with claim and claim_root
run_without_landlock = false     # true: Pods run on nodes without Landlock (a hole accepted)
```
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sandbox.contracts.errors import ConfigError
from sandbox.contracts.hostpath import DEFAULT_PATH as DEFAULT_PATH
from sandbox.contracts.hostpath import PATH_ENV as PATH_ENV
from sandbox.contracts.hostpath import host_config_path


class BackendConfig(BaseModel):
    """`[backend]`: the engine, and for Kubernetes the cluster, namespace and storage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["docker", "kubernetes"] = "docker"
    # Kubernetes only. None: $KUBECONFIG, then ~/.kube/config, then in-cluster.
    kubeconfig: str | None = None
    context: str | None = None
    namespace: str = "sandbox"
    node_selector: dict[str, str] = Field(default_factory=dict)
    # hostPath storage mounts this host's folders: the Pod must land on this host's node.
    node_name: str | None = None
    storage: Literal["hostPath", "pvc"] = "hostPath"
    # pvc: the claim holding the workflows, and where this host sees the claim's root.
    claim: str | None = None
    claim_root: str | None = None
    # Prepended to the project's image names (a registry the nodes pull from).
    image_prefix: str = ""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    # The project's seccomp profile as the nodes have it, relative to the kubelet's
    # seccomp root (`/var/lib/kubelet/seccomp` by default).
    seccomp_profile: str = "sandbox-step.json"
    # Kubernetes only. A Pod's step runs only behind its Landlock wall (the kubelet's
    # /dev/termination-log is a writable file of the node's disk in every container);
    # true lets it run on nodes whose kernel has no Landlock, that hole accepted.
    run_without_landlock: bool = False

    @model_validator(mode="after")
    def _pvc_has_claim(self) -> BackendConfig:
        if self.storage == "pvc" and not (self.claim and self.claim_root):
            raise ValueError("storage = 'pvc' needs claim and claim_root")
        if self.claim_root is not None and not self.claim_root.startswith("/"):
            raise ValueError("claim_root must be an absolute path")
        return self


# How the guard syncs the action log (sandbox/guard/actionlog.spec.md). "group": each
# line is written before its call goes on and synced in group commit off the request
# path, and the runner syncs the log when it seals the record. "per-call": each line is
# also synced before its call goes on (same-host durability, at a sync per call).
Durability = Literal["group", "per-call"]
DEFAULT_DURABILITY: Durability = "group"


class HostConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    durability: Durability = DEFAULT_DURABILITY
    backend: BackendConfig = Field(default_factory=BackendConfig)


def load_host_config(path: Path | None = None) -> HostConfig:
    """The host's settings; defaults (Docker) when no file is named and none exists."""
    path = host_config_path(path)
    if path is None:
        return HostConfig()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"host config {path} unreadable: {exc}") from None
    try:
        return HostConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"host config {path}: {problems}") from None
