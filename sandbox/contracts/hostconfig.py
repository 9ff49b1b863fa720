"""The build host's own settings: which engine runs a test run's containers, and where.

A workflow's `workflow.toml` says what a step may do; this file says where this host
runs steps. It is the host's (root's), never the workflow's: a workflow cannot pick
its own engine, cluster or storage. Read from `--host-config PATH`, else
`$SANDBOX_HOST_CONFIG`, else `/etc/sandbox/host.toml` when it exists; without any,
the Docker engine on this host runs everything.

```toml
durability = "per-call"          # or "group" (the default): see the action log's contract
accept_replayed_verifications = false   # the gate refuses replayed runs (the default)

[recording]                      # every allowed read's answer kept in the run folder
cap_bytes = 67108864             # the whole recording (64 MiB, the default)
body_cap_bytes = 16777216        # one answer (16 MiB, the default)

[backend]
kind = "kubernetes"              # or "docker" (the default)
kubeconfig = "/etc/sandbox/kubeconfig"
namespace = "sandbox-runs"
node_selector = { "sandbox.io/runner" = "true" }
storage = "hostPath"             # or "pvc" with claim and claim_root
run_without_landlock = false     # true: Pods run on nodes without Landlock (a hole accepted)
image_digests = { "sandbox-step:current" = "registry.example/sandbox-step@sha256:<64 hex>" }
```
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from sandbox.contracts import names
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.guardparts import DEFAULT_DURABILITY as DEFAULT_DURABILITY
from sandbox.contracts.guardparts import Durability as Durability
from sandbox.contracts.hostpath import DEFAULT_PATH as DEFAULT_PATH
from sandbox.contracts.hostpath import PATH_ENV as PATH_ENV
from sandbox.contracts.hostpath import host_config_path
from sandbox.contracts.recording import RecordingSettings


class BackendConfig(BaseModel):
    """`[backend]`: the engine, and for Kubernetes the cluster, namespace and storage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["docker", "kubernetes"] = Field(
        default="docker",
        description=(
            "The engine that runs test runs' containers: this host's Docker "
            "engine, or a Kubernetes cluster."
        ),
    )
    # Kubernetes only. None: $KUBECONFIG, then ~/.kube/config, then in-cluster.
    kubeconfig: str | None = Field(
        default=None,
        description=(
            "Kubernetes: the kubeconfig file; none: `$KUBECONFIG`, then "
            "`~/.kube/config`, then in-cluster."
        ),
    )
    context: str | None = Field(
        default=None, description="Kubernetes: the kubeconfig context; none: its current one."
    )
    namespace: str = Field(
        default="sandbox", description="Kubernetes: the namespace of the runs' Pods and Secrets."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Kubernetes: labels the Pod's node must have."
    )
    # hostPath storage mounts this host's folders: the Pod must land on this host's node.
    node_name: str | None = Field(
        default=None,
        description=(
            "Kubernetes: the node the Pod runs on; `hostPath` storage needs this host's own node."
        ),
    )
    storage: Literal["hostPath", "pvc"] = Field(
        default="hostPath",
        description=(
            "Kubernetes: how the Pod gets the run folder: `hostPath` (this "
            "host's folders) or `pvc` (subPaths of `claim`)."
        ),
    )
    # pvc: the claim holding the workflows, and where this host sees the claim's root.
    claim: str | None = Field(
        default=None,
        description=(
            "`pvc` storage: the PersistentVolumeClaim holding the workflows, in `namespace`."
        ),
    )
    claim_root: str | None = Field(
        default=None,
        description=(
            "`pvc` storage: where this host sees the claim's root (absolute); "
            "every workflow and Crew folder must lie under it."
        ),
    )
    # Prepended to the project's image names (a registry the nodes pull from).
    image_prefix: str = Field(
        default="",
        description=(
            "Prepended to the project's image names: a registry the nodes pull "
            "`sandbox-step:<tag>` and `sandbox-guard:<tag>` from."
        ),
    )
    # The gate vouches only for images named by content: a tag can name other code later.
    image_digests: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Kubernetes: each project image (`sandbox-step:<tag>`, `sandbox-guard:<tag>`, "
            "`sandbox-mcp:<tag>`) mapped to the reference by digest the nodes run "
            "(`registry/sandbox-step@sha256:<64 hex>`, `image_prefix` not added); the "
            "Pods and the records name that digest, so `sandbox gate` can vouch for a "
            "run. An image left out is named by `image_prefix` + its tag, which the "
            "gate never vouches for."
        ),
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Kubernetes: the Pods' image pull policy."
    )
    # The project's seccomp profile as the nodes have it, relative to the kubelet's
    # seccomp root (`/var/lib/kubelet/seccomp` by default).
    seccomp_profile: str = Field(
        default="sandbox-step.json",
        description=(
            "Kubernetes: the step's seccomp profile on the nodes, relative to "
            "the kubelet's seccomp root (`/var/lib/kubelet/seccomp`)."
        ),
    )
    # Kubernetes only. A Pod's step runs only behind its Landlock wall (the kubelet's
    # /dev/termination-log is a writable file of the node's disk in every container);
    # true lets it run on nodes whose kernel has no Landlock, that hole accepted.
    run_without_landlock: bool = Field(
        default=False,
        description=(
            "Kubernetes: let Pods run on nodes whose kernel has no Landlock "
            "(the kubelet's writable `/dev/termination-log` is then an accepted"
            " hole)."
        ),
    )

    # Kubernetes only: where the host-side work runs (docs/guides/fleet.md).
    placement: Literal["runner", "scheduler"] = Field(
        default="runner",
        description=(
            "Kubernetes: `runner` does the host-side work (disk, view, DB copy, "
            "record) on this host; `scheduler` submits each run as a Job whose Pod "
            "runs the runner on whichever node the scheduler picks (needs `pvc` "
            "storage and `runner_image`)."
        ),
    )
    runner_image: str | None = Field(
        default=None,
        description=(
            "`scheduler` placement: the runner's image (the guard image with "
            "`sandbox[kubernetes]`, images/runner/Dockerfile)."
        ),
    )
    runner_service_account: str = Field(
        default="sandbox-runner",
        description=(
            "`scheduler` placement: the runner Pods' service account in "
            "`namespace` (its Role: docs/guides/fleet.md)."
        ),
    )

    # For clusters whose Pods reach the API server only through their node (a local
    # cluster whose API server listens on loopback): the runner's Pod then uses the
    # node's network and names the API server itself.
    runner_host_network: bool = Field(
        default=False,
        description=(
            "`scheduler` placement: run the runner's Pod in its node's network "
            "namespace (only for clusters whose Pods reach the API server through "
            "the node alone, such as a local one on loopback)."
        ),
    )
    runner_api_server: str | None = Field(
        default=None,
        pattern=r"^[0-9A-Za-z.-]+:[0-9]{1,5}$",
        description=(
            "`scheduler` placement: HOST:PORT where the runner's Pod reaches the API "
            "server; none: the cluster's `kubernetes` Service, as any in-cluster client."
        ),
    )

    def image_ref(self, image: str) -> str:
        """The reference a Pod runs for one of the project's images (and its record names)."""
        return self.image_digests.get(image) or self.image_prefix + image

    @field_validator("image_digests")
    @classmethod
    def _by_digest(cls, value: dict[str, str]) -> dict[str, str]:
        for image, ref in value.items():
            if not names.is_digest_ref(ref):
                raise ValueError(
                    f"image_digests[{image!r}] = {ref!r} is not a reference by digest "
                    "(NAME@sha256:<64 hex>)"
                )
        return value

    @model_validator(mode="after")
    def _pvc_has_claim(self) -> BackendConfig:
        if self.storage == "pvc" and not (self.claim and self.claim_root):
            raise ValueError("storage = 'pvc' needs claim and claim_root")
        if self.placement == "scheduler" and (self.storage != "pvc" or not self.runner_image):
            raise ValueError("placement = 'scheduler' needs storage = 'pvc' and runner_image")
        if self.claim_root is not None and not self.claim_root.startswith("/"):
            raise ValueError("claim_root must be an absolute path")
        return self

    @classmethod
    def preloaded_cluster(
        cls,
        kubeconfig: str | Path,
        namespace: str,
        seccomp_profile: str,
        *,
        claim: tuple[str, Path] | None = None,
        runner_image: str | None = None,
        **more: Any,
    ) -> BackendConfig:
        """`[backend]` for runs on a cluster whose nodes already hold the project's
        images (loaded there, never pulled) and the step's seccomp profile (installed
        under the kubelet's profile folder as `seccomp_profile`): the local test
        cluster's and the Kubernetes bench's. `claim` (its name, the folder its volume
        is, as this host sees it): the run folders through it (`storage = "pvc"`);
        `runner_image` with it: each run a Job the scheduler places. `more` on top,
        validated as any host config is."""
        fields: dict[str, Any] = {
            "kind": "kubernetes",
            "kubeconfig": str(kubeconfig),
            "namespace": namespace,
            "image_pull_policy": "Never",
            "seccomp_profile": seccomp_profile,
        }
        if claim is not None:
            fields |= {"storage": "pvc", "claim": claim[0], "claim_root": str(claim[1])}
        if runner_image is not None:
            fields |= {"placement": "scheduler", "runner_image": runner_image}
        return cls.model_validate({**fields, **more})


class HostConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    durability: Durability = Field(
        default=DEFAULT_DURABILITY,
        description=(
            "How the guard syncs the action log: `group` writes each line "
            "before its call goes on and syncs in group commit off the request "
            "path (and when the record is sealed); `per-call` also syncs each "
            "line before its call goes on (same-host durability, at a sync per "
            "forwarded call)."
        ),
    )
    backend: BackendConfig = Field(
        default_factory=BackendConfig, description="Where this host runs test runs (`[backend]`)."
    )
    recording: RecordingSettings = Field(
        default_factory=RecordingSettings,
        description=(
            "`[recording]`: every allowed read's answer kept in the run folder, and its caps "
            "(`cap_bytes`, `body_cap_bytes`)."
        ),
    )
    accept_replayed_verifications: bool = Field(
        default=False,
        description=(
            "Whether the gate accepts a verification of a replayed run (reads served from "
            "a recording, not the world); off: only live runs pass the gate."
        ),
    )


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
