"""One test run as one Pod (and the guard's config as one Secret), as plain manifests.

Pure: built from the same `ContainerSpec`s (`sandbox.launch.specs`, from the run's
`RunPlan`) the Docker backend turns into containers, so the users, mounts, environment
and limits are decided in one place; this module only says how each becomes Pod
fields. No API call.

The Pod:
- an init container `firewall` (uid 0, every capability dropped but NET_ADMIN) puts
  `sandbox.launch.firewall.rules()` in the Pod's network namespace, prints them back
  and fails unless they read back exactly, so no other container starts on a wrong wall;
- the guard as a sidecar, started as Docker's guard entry is (root with NET_ADMIN,
  SETUID, SETGID and SETPCAP only, `firewall.pod_guard_entry_script`): the entry binds
  the refused packets' log group and drops to uid and gid 10002 with no capability in
  any set before the guard's code runs; no privilege escalation, read-only root; it
  alone mounts the Secret with its config (mode 0400, group 10002: the kubelet adds
  group read for the Pod's fsGroup) and the run's action log;
- the step: its uid (10001 under a root runner), no capability, no privilege escalation,
  read-only root, memory and CPU limits, its three writable folders of the run's disk,
  the workflow view and every Crew folder read-only;
- the project's seccomp profile as a `Localhost` profile for every container; no
  service-account token, no host network, PID or IPC namespace, no process namespace
  shared between containers, no service links; `restartPolicy: Never`; an
  `activeDeadlineSeconds` (the longest step timeout, lowered to the step's own once it
  runs), so a Pod whose runner died still ends.

Storage: `hostPath` (the runner's own folders; one node, or the Pod pinned to the
runner's node) or one PersistentVolumeClaim whose root the runner sees at `claim_root`,
each folder a `subPath` of it (the kubelet resolves a subPath without following a link
out of the volume). Every mount's source must lie under `claim_root`: a Crew folder
elsewhere is refused. With a claim the Pod sets no `fsGroup`, because a volume plugin
that manages ownership would re-own the whole claim (the real workflow folders with
it) for the Pod's group; the guard's Secret is then mode 0444, which only the guard's
container sees (it alone mounts the Secret, and no container shares another's process
or mount namespace).

Stdio MCP servers: each one a container `mcp-<index>` of the same Pod, with what a
Pod can say of its Docker container (`launch.mcp_server_spec`): its own uid and gid,
no capability, no privilege escalation, read-only root, its /tmp a memory emptyDir
with the same size, the Pod's seccomp profile, memory and CPU limits; it mounts the
workflow view and its own folder of the guard's sockets (the host folder the runner
made: the guard's, passable by that server's group alone) read-only, and the step
mounts none of them. The Pod's namespace is shared, so the init container's firewall
adds rules per uid (`firewall.PodPeers`): the step opens connections only to the
guard's ports, each server only to its own relay's port (`layout.mcp_proxy_port`),
neither reaches the network.

Limits, from the Pod API: IPC and UTS namespaces are the Pod's, shared by its
containers (Docker gives the step a private IPC namespace; System V IPC objects of
one container are visible to the others, as far as their modes allow); so are the
abstract unix socket names (the guard binds none: its sockets are paths); a server
sees the Pod's interfaces (only its uid's rules keep it off them); a Pod spec has no
per-container pids limit (the node's `podPidsLimit` caps the whole Pod).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from sandbox.contracts import names
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.guardconfig import (
    BRIDGE_PORT,
    CONFIG_FILE_ENV,
    CONFIG_FILE_NAME,
    EGRESS_PORT,
)
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.layout import GUARD_UID, MCP_UID_BASE
from sandbox.contracts.names import (
    LABEL_MANAGED,
    LABEL_ROLE,
    LABEL_RUN_ID,
    LABEL_RUN_ROOT,
    LABEL_RUNNER_BOOT,
    LABEL_RUNNER_PID,
    LABEL_RUNNER_START,
    LABEL_RUNNER_TICKS,
)
from sandbox.contracts.spec import ContainerSpec, Mount
from sandbox.launch import firewall
from sandbox.launch import specs as launch
from sandbox.stepside.agentworks_exec.interface import LANDLOCK_ENV

# Annotations (values a label cannot hold: paths, host names).
ANNOTATION_RUN_ROOT = LABEL_RUN_ROOT
ANNOTATION_RUNNER_HOST = "sandbox.runner-host"
LABEL_RUNNER_HOST = "sandbox.runner-host"  # only when the host name is a valid label value
FIREWALL = "firewall"
GUARD = "guard"
STEP = "step"
MCP_PREFIX = "mcp-"  # and the server's index: a DNS label whatever the server's name
SECRET_DIR = "/guard/secret"
SECRET_MODE = 0o400  # and group read for the Pod's fsGroup (the guard's gid)
SECRET_MODE_NO_FSGROUP = 0o444  # storage on a claim: no fsGroup (see the module's doc)
# The kubelet writes a Secret's files into a timestamped folder and links `..data` and
# each file's name to it: the guard opens the file itself (it follows no final link).
SECRET_CONFIG_PATH = f"{SECRET_DIR}/..data/{CONFIG_FILE_NAME}"
GRACE_S = 2
# The Pod's life: at most the longest step timeout and a margin, until the run lowers
# it to the step's own timeout; past it the kubelet stops every container.
DEADLINE_MARGIN_S = 120
MAX_DEADLINE_S = 24 * 3600 + DEADLINE_MARGIN_S
CPU_REQUEST_MILLI = 100  # what the scheduler reserves; the limit is the spec's


def object_name(run_id: str) -> str:
    """The Pod's name: the run id as a DNS name (lower case)."""
    return f"sandbox-{run_id.lower()}"


def secret_name(run_id: str) -> str:
    return f"{object_name(run_id)}-guard"


def _label_value(text: str) -> str | None:
    """`text` if Kubernetes takes it as a label value, else None."""
    ok = len(text) <= 63 and all(c.isalnum() or c in "-_." for c in text)
    return text if ok and (not text or (text[0].isalnum() and text[-1].isalnum())) else None


@dataclass(frozen=True)
class RunMeta:
    """What the Pod says about its run, beside its containers."""

    run_id: str
    run_root: str
    runner_pid: str
    runner_start: str
    runner_host: str
    install_firewall: bool = True
    # The runner's start in clock ticks and its boot (`gc` compares these when present).
    runner_ticks: str | None = None
    runner_boot: str | None = None
    # Host sources that are files (a hostPath says File or Directory).
    files: frozenset[str] = frozenset()

    @classmethod
    def of(cls, guard: ContainerSpec, *, runner_host: str, files: frozenset[str]) -> RunMeta:
        """From the guard's spec: its labels name the run, its entry script says whether
        it installs the firewall (only tests of the preflight run without)."""
        labels = guard.labels
        script = (guard.entrypoint or [""])[-1]
        return cls(
            run_id=labels[LABEL_RUN_ID],
            run_root=labels[LABEL_RUN_ROOT],
            runner_pid=labels[LABEL_RUNNER_PID],
            runner_start=labels[LABEL_RUNNER_START],
            runner_host=runner_host,
            runner_ticks=labels.get(LABEL_RUNNER_TICKS),
            runner_boot=labels.get(LABEL_RUNNER_BOOT),
            install_firewall=script
            != firewall.guard_entry_script(launch.GUARD_COMMAND, GUARD_UID, install=False),
            files=files,
        )


def run_labels(meta: RunMeta) -> dict[str, str]:
    """What `sandbox gc` selects by, on the Pod and the Secret alike."""
    labels = {
        LABEL_MANAGED: "true",
        LABEL_RUN_ID: meta.run_id,
        LABEL_ROLE: "run",
        LABEL_RUNNER_PID: meta.runner_pid,
        LABEL_RUNNER_START: meta.runner_start,
    }
    if meta.runner_ticks is not None and meta.runner_boot is not None:
        labels[LABEL_RUNNER_TICKS] = meta.runner_ticks
        labels[LABEL_RUNNER_BOOT] = meta.runner_boot
    host = _label_value(meta.runner_host)
    if host is not None:
        labels[LABEL_RUNNER_HOST] = host
    return labels


def run_annotations(meta: RunMeta) -> dict[str, str]:
    return {ANNOTATION_RUN_ROOT: meta.run_root, ANNOTATION_RUNNER_HOST: meta.runner_host}


class _Volumes:
    """Each host folder or file once, as a hostPath volume or a subPath of the claim."""

    def __init__(self, settings: BackendConfig, files: set[str]) -> None:
        self.settings = settings
        self.files = files
        self.volumes: list[dict[str, Any]] = []
        self._by_source: dict[str, str] = {}
        if settings.storage == "pvc":
            self.volumes.append(
                {"name": "storage", "persistentVolumeClaim": {"claimName": settings.claim}}
            )

    def mount(self, mount: Mount) -> dict[str, Any]:
        if self.settings.storage == "pvc":
            assert self.settings.claim_root is not None
            root = PurePosixPath(self.settings.claim_root)
            source = PurePosixPath(mount.source)
            if not source.is_relative_to(root) or ".." in source.parts:
                raise ConfigError(
                    f"{mount.source} is not on the run's storage claim (claim_root {root})"
                )
            sub = str(source.relative_to(root))
            return {
                "name": "storage",
                "mountPath": mount.target,
                "readOnly": mount.read_only,
                **({"subPath": sub} if sub != "." else {}),
            }
        name = self._by_source.get(mount.source)
        if name is None:
            name = f"host-{len(self._by_source)}"
            self._by_source[mount.source] = name
            kind = "File" if mount.source in self.files else "Directory"
            self.volumes.append({"name": name, "hostPath": {"path": mount.source, "type": kind}})
        return {"name": name, "mountPath": mount.target, "readOnly": mount.read_only}


def _resources(spec: ContainerSpec) -> dict[str, Any]:
    milli = max(1, round(spec.cpus * 1000))
    memory = str(spec.memory_bytes)
    return {
        "limits": {"cpu": f"{milli}m", "memory": memory},
        "requests": {"cpu": f"{min(milli, CPU_REQUEST_MILLI)}m", "memory": memory},
    }


def _locked_down(uid: int, gid: int, *, add: list[str] | None = None) -> dict[str, Any]:
    return {
        "runAsUser": uid,
        "runAsGroup": gid,
        "runAsNonRoot": uid != 0,
        "capabilities": {"drop": ["ALL"], **({"add": add} if add else {})},
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "procMount": "Default",
    }


def _user(spec: ContainerSpec) -> tuple[int, int]:
    uid, _, gid = spec.user.partition(":")
    return int(uid), int(gid or uid)


def _env(env: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in env.items()]


def _image(settings: BackendConfig, image: str) -> str:
    return settings.image_ref(image)


def _tmpfs_size(options: str) -> str | None:
    for option in options.split(","):
        key, _, value = option.partition("=")
        if key == "size" and value:
            return value[:-1] + "Mi" if value.endswith("m") else value
    return None


def mcp_container_name(spec: ContainerSpec) -> str:
    """A server's container name, from its uid (`layout.mcp_uid(index)`)."""
    return f"{MCP_PREFIX}{_user(spec)[0] - MCP_UID_BASE}"


def _relay_port(spec: ContainerSpec) -> int | None:
    """The proxy port the server's relay listens on (`--proxy-port`), if it has one."""
    args = spec.command
    for i, arg in enumerate(args[:-1]):
        if arg == "--":
            break
        if arg == "--proxy-port":
            return int(args[i + 1])
    return None


def firewall_peers(step: ContainerSpec, servers: list[ContainerSpec]) -> firewall.PodPeers | None:
    """The Pod's peers of the guard, as the runner reads them from the plan
    (`launch.pod_peers`): the init container checks the read-back against these."""
    if not servers:
        return None
    return firewall.PodPeers(
        step_uid=_user(step)[0],
        guard_ports=(BRIDGE_PORT, EGRESS_PORT),
        servers=tuple(
            (_user(s)[0], _relay_port(s)) for s in sorted(servers, key=lambda s: _user(s)[0])
        ),
    )


def _mcp_container(
    spec: ContainerSpec, settings: BackendConfig, volumes: _Volumes
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One stdio server's container, and its /tmp volume."""
    if set(spec.tmpfs) - {"/tmp"}:
        raise ConfigError(f"a server's tmpfs other than /tmp: {sorted(spec.tmpfs)}")
    uid, gid = _user(spec)
    name = mcp_container_name(spec)
    tmp = f"{name}-tmp"
    container = {
        "name": name,
        "image": _image(settings, spec.image),
        "imagePullPolicy": settings.image_pull_policy,
        "command": spec.entrypoint,
        "args": spec.command,
        "workingDir": spec.workdir,
        "env": _env(spec.env),
        "securityContext": _locked_down(uid, gid),
        "resources": _resources(spec),
        "volumeMounts": [
            *(volumes.mount(m) for m in spec.mounts),
            {"name": tmp, "mountPath": "/tmp"},
        ],
        "terminationMessagePolicy": "File",
    }
    size = _tmpfs_size(spec.tmpfs.get("/tmp", "")) or "16Mi"
    return container, {"name": tmp, "emptyDir": {"medium": "Memory", "sizeLimit": size}}


def _landlock_mode(settings: BackendConfig, with_servers: bool) -> str:
    """How strict the step's Landlock wall must be on this Pod: required (the kubelet's
    0666 /dev/termination-log), and scoped too beside stdio MCP servers (they share the
    step's network namespace, so an abstract unix socket of theirs would be a way round
    the guard); `apply` where the host config accepts those holes."""
    if settings.run_without_landlock:
        return "apply"
    return "require-scoped" if with_servers else "require"


def pod_manifest(
    guard: ContainerSpec,
    step: ContainerSpec,
    settings: BackendConfig,
    meta: RunMeta,
    servers: list[ContainerSpec] | None = None,
) -> dict[str, Any]:
    """The run's Pod. Raises ConfigError for what a Pod cannot hold as Docker would."""
    if guard.network_mode != "none":
        raise ConfigError(
            "bridge.networks names Docker networks; on Kubernetes the guard reaches its "
            "upstream through the Pod network (give --upstream-bridge an address it can reach)"
        )
    volumes = _Volumes(settings, set(meta.files))
    pull = settings.image_pull_policy

    step_uid, step_gid = _user(step)
    step_container: dict[str, Any] = {
        "name": STEP,
        "image": _image(settings, step.image),
        "imagePullPolicy": pull,
        "args": step.command,
        "workingDir": step.workdir,
        # The kubelet's /dev/termination-log is a 0666 file of the node's disk in every
        # container: no step without the Landlock wall unless the host accepts that hole.
        "env": _env({**step.env, LANDLOCK_ENV: _landlock_mode(settings, bool(servers))}),
        "securityContext": _locked_down(step_uid, step_gid),
        "resources": _resources(step),
        "volumeMounts": [volumes.mount(m) for m in step.mounts],
        "terminationMessagePolicy": "File",
    }

    guard_mounts = [volumes.mount(m) for m in guard.mounts]
    guard_mounts.append({"name": "guard-config", "mountPath": SECRET_DIR, "readOnly": True})
    tmp_size = _tmpfs_size(guard.tmpfs.get("/tmp", ""))
    guard_mounts.append({"name": "guard-tmp", "mountPath": "/tmp"})
    guard_container: dict[str, Any] = {
        "name": GUARD,
        "image": _image(settings, guard.image),
        "imagePullPolicy": pull,
        # Docker's guard entry, less the rules the init container installed: root with
        # the entry's capabilities only until it has bound the refused packets' log
        # group and dropped to the guard's uid with none (before the guard's code runs).
        "command": ["/bin/sh", "-c"],
        "args": [
            firewall.pod_guard_entry_script(
                launch.GUARD_COMMAND, GUARD_UID, install=meta.install_firewall
            )
        ],
        "env": _env({**guard.env, CONFIG_FILE_ENV: SECRET_CONFIG_PATH}),
        "securityContext": _locked_down(0, 0, add=list(launch.GUARD_ENTRY_CAPS)),
        "resources": _resources(guard),
        "volumeMounts": guard_mounts,
    }
    firewall_container: dict[str, Any] = {
        "name": FIREWALL,
        "image": _image(settings, names.GUARD_IMAGE),
        "imagePullPolicy": pull,
        "command": ["/bin/sh", "-c"],
        "args": [
            firewall.init_container_script(
                GUARD_UID,
                install=meta.install_firewall,
                peers=firewall_peers(step, list(servers or [])),
            )
        ],
        "securityContext": _locked_down(0, 0, add=["NET_ADMIN"]),
        "resources": {
            "limits": {"cpu": "500m", "memory": "64Mi"},
            "requests": {"cpu": "10m", "memory": "64Mi"},
        },
    }

    mcp = [_mcp_container(s, settings, volumes) for s in servers or []]
    on_claim = settings.storage == "pvc"
    volumes_list = [
        *volumes.volumes,
        {
            "name": "guard-config",
            "secret": {
                "secretName": secret_name(meta.run_id),
                "defaultMode": SECRET_MODE_NO_FSGROUP if on_claim else SECRET_MODE,
                "items": [{"key": CONFIG_FILE_NAME, "path": CONFIG_FILE_NAME}],
            },
        },
        {"name": "guard-tmp", "emptyDir": {"medium": "Memory", "sizeLimit": tmp_size or "16Mi"}},
        *(volume for _, volume in mcp),
    ]
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "shareProcessNamespace": False,
        "terminationGracePeriodSeconds": GRACE_S,
        "activeDeadlineSeconds": MAX_DEADLINE_S,
        "securityContext": {
            "seccompProfile": {"type": "Localhost", "localhostProfile": settings.seccomp_profile},
            # The Secret's group: the guard's, so its uid reads its config (mode 0400 + g+r).
            # hostPath volumes are never re-owned for it; a claim's volume may be.
            **({} if on_claim else {"fsGroup": GUARD_UID}),
            "sysctls": [{"name": k, "value": v} for k, v in guard.sysctls.items()],
        },
        "initContainers": [firewall_container],
        "containers": [guard_container, step_container, *(c for c, _ in mcp)],
        "volumes": volumes_list,
    }
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.node_name:
        spec["nodeName"] = settings.node_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": object_name(meta.run_id),
            "namespace": settings.namespace,
            "labels": run_labels(meta),
            "annotations": run_annotations(meta),
        },
        "spec": spec,
    }


def secret_manifest(meta: RunMeta, settings: BackendConfig, config_json: bytes) -> dict[str, Any]:
    """The guard's config as a Secret: only the guard's container mounts it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": secret_name(meta.run_id),
            "namespace": settings.namespace,
            "labels": {**run_labels(meta), LABEL_ROLE: "guard-config"},
            "annotations": run_annotations(meta),
        },
        "data": {CONFIG_FILE_NAME: base64.b64encode(config_json).decode("ascii")},
    }


def deadline_patch(elapsed_s: float, timeout_s: float) -> dict[str, Any]:
    """The Pod's deadline lowered to the step's timeout (from the Pod's start) and a margin."""
    seconds = min(MAX_DEADLINE_S, int(elapsed_s + timeout_s) + DEADLINE_MARGIN_S)
    return {"spec": {"activeDeadlineSeconds": seconds}}
