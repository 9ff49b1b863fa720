"""What a dead fleet runner left on its node: removed by a short Job pinned there.

A runner killed outright (SIGKILL, OOM, its container gone) leaves on its node what
it mounted for its run: the step's disk (its loop device goes with its last mount)
and the workflow view, below `runs/test-<id>/` on the claim, propagated to the node
through the claim's `Bidirectional` mount. Only a privileged process on that node
can remove them, so `sandbox gc` (`fleetgc`) submits this module's Job: the runner
image, pinned to the dead runner's node by `nodeName` (a cordoned node still runs
it), with the claim mounted as the runner mounts it and no service-account token.
In its Pod, `main` removes only what belongs to the one run named by its id (the
mounts below that run folder, found in the mount table, never by following a path
inside it; the disk image, detached and deleted if it is a plain file): the same
code `sandbox gc` uses on a host (`stepfs.disk.reap`). Each removed path is printed
on a line of its own for gc's report.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path, PurePosixPath
from typing import Any

from sandbox.contracts.hostconfig import BackendConfig
from sandbox.contracts.layout import STEPS_DIR

from .fleet import RUN_ID, RUNNER_CLAIM_ROOT

LABEL_CLEANUP = "sandbox.fleet-cleanup"  # its value: the run id the Job cleans up
REMOVED_MARK = "sandbox-fleet-removed: "
CLEANUP_DEADLINE_S = 600  # a node that never runs it: the Job still ends
CLEANUP_TTL_S = 600  # an ended Job gc did not wait for goes by itself


def cleanup_job_manifest(
    settings: BackendConfig, workflow: str, run_id: str, node: str, name: str
) -> dict[str, Any]:
    """The cleanup Job of one dead run on `node` (pure)."""
    if settings.runner_image is None:
        raise ValueError("a cleanup Job needs the runner image")
    labels = {LABEL_CLEANUP: run_id}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "nodeName": node,  # the node whose mounts these are, cordoned or not
        "tolerations": [{"operator": "Exists"}],
        "serviceAccountName": settings.runner_service_account,
        "automountServiceAccountToken": False,  # it calls no API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 10,
        "containers": [
            {
                "name": "cleanup",
                "image": settings.runner_image,
                "imagePullPolicy": settings.image_pull_policy,
                "command": [
                    "python3",
                    "-m",
                    "sandbox.backends.kubernetes.fleetclean",
                    workflow,
                    run_id,
                ],
                "env": [{"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
                # umount2 and LOOP_CLR_FD on the node's mounts, as the runner that made them.
                "securityContext": {"privileged": True, "runAsUser": 0},
                "volumeMounts": [
                    {
                        "name": "claim",
                        "mountPath": RUNNER_CLAIM_ROOT,
                        # Its unmounts reach the node, as the runner's mounts did.
                        "mountPropagation": "Bidirectional",
                    }
                ],
            }
        ],
        "volumes": [{"name": "claim", "persistentVolumeClaim": {"claimName": settings.claim}}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": CLEANUP_DEADLINE_S,
            "ttlSecondsAfterFinished": CLEANUP_TTL_S,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def run_root_in_pod(workflow: str, run_id: str) -> Path:
    """The run folder on this Pod's claim, refused unless every component is a real
    folder (no link on the way: the run's id and path come from the Job, never the step)."""
    rel = PurePosixPath(workflow)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts or not RUN_ID.match(run_id):
        raise ValueError(f"not a run: {workflow!r} {run_id!r}")
    path = Path(RUNNER_CLAIM_ROOT)
    for part in (*rel.parts, "runs", run_id):
        path = path / part
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{path} is not a folder")
    return path


def _step_roots(root: Path) -> list[Path]:
    """A chain's step run folders (real folders only), each reaped before the chain's."""
    steps = root / STEPS_DIR
    if steps.is_symlink() or not steps.is_dir():
        return []
    return sorted(p for p in steps.iterdir() if p.is_dir() and not p.is_symlink())


def main(argv: list[str]) -> int:
    from sandbox.stepfs import disk

    if len(argv) != 2:
        print("usage: fleetclean <workflow under the claim> <run id>", file=sys.stderr)
        return 2
    try:
        root = run_root_in_pod(*argv)
    except FileNotFoundError:
        return 0  # no run folder: nothing of it can be mounted
    except (OSError, ValueError) as exc:
        print(f"fleetclean: {exc}", file=sys.stderr)
        return 2
    failed = False
    for run_root in [*_step_roots(root), root]:
        try:
            for path in disk.reap(run_root):
                print(f"{REMOVED_MARK}{path}", flush=True)
        except OSError as exc:
            print(f"fleetclean: {run_root}: {exc}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
