"""What the cluster tests share: the outside world's server Pods (locked down, small),
a watch on one Pod until it is where a test needs it, exec, the run's Pod and its
processes read from the host (by the Pod's cgroup, never by name: other runs on this
host use the same uids). A namespace of a test's own is testbed/kubernetes/namespace.py's.

Public helpers, no fixtures (those are in `conftest.py`): no test module imports
another, so `test_pod_shape.py` takes its Pod parts from here like the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest
from kubernetes import stream, watch

from sandbox.contracts import names

OUTSIDE_PORT = 8080
WATCH_DEADLINE_S = 120


def locked_down(uid: int, seccomp: dict[str, str] | None = None) -> dict[str, Any]:
    """A container's security context: `uid`, no capability, no privilege escalation,
    a read-only root, `seccomp` (the runtime's default profile unless given)."""
    return {
        "runAsUser": uid,
        "runAsGroup": uid,
        "runAsNonRoot": uid != 0,
        "capabilities": {"drop": ["ALL"]},
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "seccompProfile": seccomp or {"type": "RuntimeDefault"},
    }


def small(cpu: str = "250m", memory: str = "128Mi") -> dict[str, Any]:
    """A container's resources: these limits, a small CPU request."""
    return {"limits": {"cpu": cpu, "memory": memory}, "requests": {"cpu": "10m", "memory": memory}}


def outside_server_pod() -> dict[str, Any]:
    """The outside world: `outside`, a Pod serving `/` over HTTP on OUTSIDE_PORT from
    the guard image, locked down as nobody."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "outside", "labels": {"sandbox.test": "outside"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "containers": [
                {
                    "name": "server",
                    "image": names.GUARD_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": [
                        "python3",
                        "-m",
                        "http.server",
                        str(OUTSIDE_PORT),
                        "--directory",
                        "/",
                    ],
                    "securityContext": locked_down(65534),
                    "resources": small(),
                }
            ],
        },
    }


def watch_pod(core: Any, namespace: str, name: str, resource_version: str, done: Any) -> Any:
    """Follow one Pod's events until `done(pod)` holds; fail if the watch ends first."""
    w = watch.Watch()
    for event in w.stream(
        core.list_namespaced_pod,
        namespace,
        field_selector=f"metadata.name={name}",
        resource_version=resource_version,
        timeout_seconds=WATCH_DEADLINE_S,
    ):
        pod = event["object"]
        if done(pod):
            w.stop()
            return pod
        if pod.status.phase == "Failed":
            w.stop()
            pytest.fail(f"pod {name} failed: {pod.status}")
    pytest.fail(f"pod {name}: no end seen within {WATCH_DEADLINE_S} s")


def container_state(pod: Any, container: str) -> Any:
    """The state of the Pod's `container`; None before the kubelet reports it."""
    for status in pod.status.container_statuses or []:
        if status.name == container:
            return status.state
    return None


def server_pod(name: str, command: list[str], volumes: dict[str, Path]) -> dict[str, Any]:
    """A Pod of one `server` container (the guard image, locked down) running `command`,
    with host folders mounted read-only (target -> source)."""
    pod = outside_server_pod()
    pod["metadata"]["name"] = name
    container = pod["spec"]["containers"][0]
    container["command"] = command
    container["volumeMounts"] = [
        {"name": f"v{i}", "mountPath": target, "readOnly": True} for i, target in enumerate(volumes)
    ]
    pod["spec"]["volumes"] = [
        {"name": f"v{i}", "hostPath": {"path": str(source), "type": "Directory"}}
        for i, source in enumerate(volumes.values())
    ]
    return pod


def start_server(core: Any, namespace: str, manifest: dict[str, Any]) -> str:
    """Create a server Pod; its IP once its container runs."""
    name = manifest["metadata"]["name"]
    created = core.create_namespaced_pod(namespace, manifest)
    ready = watch_pod(
        core,
        namespace,
        name,
        created.metadata.resource_version,
        lambda p: p.status.pod_ip and getattr(container_state(p, "server"), "running", None),
    )
    return str(ready.status.pod_ip)


def exec_in(core: Any, namespace: str, pod: str, argv: list[str]) -> str:
    """`argv` in the Pod's first container; its stdout and stderr.

    The client's request method is swapped for the exec's while it runs: a client
    another thread uses at the same time must not be `core`'s."""
    return str(
        stream.stream(
            core.connect_get_namespaced_pod_exec,
            pod,
            namespace,
            command=argv,
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
        )
    )


def http_get_in(core: Any, namespace: str, pod: str, url: str) -> str:
    """The body of a GET of `url`, made from inside the Pod (its own loopback)."""
    code = f"import urllib.request;print(urllib.request.urlopen({url!r}).read().decode())"
    return exec_in(core, namespace, pod, ["python3", "-c", code])


def pod_of(core: Any, namespace: str, run_id: str) -> Any:
    (pod,) = core.list_namespaced_pod(
        namespace, label_selector=f"{names.LABEL_RUN_ID}={run_id}"
    ).items
    return pod


def processes_of(pod_uid: str, uid: int) -> list[psutil.Process]:
    """The host's processes in the Pod's cgroups running as `uid`."""
    marker = "pod" + pod_uid
    found = []
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"].real != uid:
                continue
            if marker in Path(f"/proc/{proc.pid}/cgroup").read_text():
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def proc_status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def node_mounts_of(cluster: Any, node: str, run_id: str) -> list[str]:
    """The mount points in `node`'s mount namespace (its holder's) naming the run's
    folder (as mount point or as the mounted folder's root)."""
    holder_name = "namespaces" if node == cluster.node_name else f"namespaces-{node}"
    (holder,) = [d for d in cluster.state.daemons if d.name == holder_name]
    found = []
    for line in Path(f"/proc/{holder.pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if any(f"/{run_id}/" in f + "/" for f in fields[3:5]):
            found.append(fields[4])
    return found


def loops_of(run_id: str) -> list[str]:
    """The loop devices (one kernel for every node here) backed by a file of the run."""
    found = []
    for entry in Path("/sys/block").glob("loop*"):
        try:
            backing = (entry / "loop" / "backing_file").read_text()
        except OSError:
            continue
        if f"/{run_id}/" in backing:
            found.append(f"{entry.name}: {backing.strip()}")
    return found


def run_objects(core: Any, namespace: str) -> list[str]:
    """The names of the runs' Pods and Secrets left in the namespace."""
    selector = f"{names.LABEL_MANAGED}=true"
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    secrets_ = core.list_namespaced_secret(namespace, label_selector=selector).items
    return [f"pod/{p.metadata.name}" for p in pods] + [
        f"secret/{s.metadata.name}" for s in secrets_
    ]


def no_pods_or_secrets(core: Any, namespace: str) -> None:
    assert run_objects(core, namespace) == []
