"""A Kubernetes namespace of a caller's own on the local cluster (not the Linux
namespaces of `cluster/namespaces.py`): made with its default service account (Pods
need it to be admitted), deleted afterwards with everything in it, so a test or a
benchmark leaves nothing in the cluster it shares with others.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kubernetes import watch


@contextmanager
def namespace_of_its_own(core: Any) -> Iterator[str]:
    """A fresh namespace whose default service account exists (Pods need it to be
    admitted), deleted afterwards with everything in it."""
    name = f"t-{secrets.token_hex(4)}"
    core.create_namespace({"metadata": {"name": name}})
    try:
        w = watch.Watch()
        for event in w.stream(core.list_namespaced_service_account, name, timeout_seconds=60):
            if event["object"].metadata.name == "default":
                w.stop()
                break
        else:
            raise AssertionError(f"no default service account in {name} within 60 s")
        yield name
    finally:
        core.delete_namespace(name)
