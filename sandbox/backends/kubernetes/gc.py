"""Removing what crashed runners left on the cluster: the runs' Pods and Secrets.

A Pod or Secret labelled `sandbox.managed` belongs to a live run while its runner is
alive. A runner on this host is checked by pid and start time (as on Docker); a runner
on another host cannot be, so its Pod is removed only once it has ended (every run's
Pod ends by its `activeDeadlineSeconds`). A Secret goes with its Pod (its owner: the
cluster deletes it), and here when its runner on this host is dead and no Pod of its
run is left (a runner that died between creating the Secret and the Pod). Returned: the run
roots of the removed Pods (this host's part, `collect_host`, marks their records).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from sandbox.backends.docker.gc import GcReport, orphaned
from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.names import LABEL_MANAGED, LABEL_RUN_ID, LABEL_RUN_ROOT

from . import pod as manifests


def _ours(metadata: Any) -> bool:
    """Whether this host ran it (the runner's host name is in an annotation)."""
    annotations = metadata.annotations or {}
    return bool(annotations.get(manifests.ANNOTATION_RUNNER_HOST) == socket.gethostname())


def collect_cluster(api: Any, settings: BackendConfig, report: GcReport) -> set[Path]:
    core = client.CoreV1Api(api)
    roots: set[Path] = set()
    namespace = settings.namespace
    selector = f"{LABEL_MANAGED}=true"
    try:
        pods = core.list_namespaced_pod(namespace, label_selector=selector).items
        secrets = core.list_namespaced_secret(namespace, label_selector=selector).items
    except ApiException as exc:
        report.errors.append(f"cluster: listing namespace {namespace}: {exc.status} {exc.reason}")
        return roots
    if settings.placement == "scheduler":
        from .fleetgc import collect_fleet

        # The runs' Pods are the fleet runners': a live runner removes its own, a dead
        # one's are removed here. None was made by a runner on this host.
        collect_fleet(api, settings, report)
        return roots
    left: set[str] = set()
    for pod in pods:
        labels = pod.metadata.labels or {}
        ended = (pod.status.phase or "") in ("Succeeded", "Failed")
        if not (ended or (_ours(pod.metadata) and orphaned(labels))):
            left.add(labels.get(LABEL_RUN_ID, ""))
            continue
        try:
            core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
            report.pods_removed.append(pod.metadata.name)
        except ApiException as exc:
            if exc.status != 404:
                report.errors.append(f"cluster: pod {pod.metadata.name}: {exc.reason}")
                left.add(labels.get(LABEL_RUN_ID, ""))
                continue
        root = (pod.metadata.annotations or {}).get(LABEL_RUN_ROOT)
        if root and _ours(pod.metadata):
            roots.add(Path(root))
    for secret in secrets:
        labels = secret.metadata.labels or {}
        if labels.get(LABEL_RUN_ID, "") in left:
            continue
        if not (_ours(secret.metadata) and orphaned(labels)):
            continue  # another host's: the cluster deletes it with its Pod, its owner
        try:
            core.delete_namespaced_secret(secret.metadata.name, namespace)
            report.secrets_removed.append(secret.metadata.name)
        except ApiException as exc:
            if exc.status != 404:
                report.errors.append(f"cluster: secret {secret.metadata.name}: {exc.reason}")
    return roots
