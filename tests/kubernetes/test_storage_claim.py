"""The run folder through a PersistentVolumeClaim (`[backend] storage = "pvc"`).

The test makes a hostPath-backed PersistentVolume whose path is the folder the runner
writes through (`claim_root`, on the node's storage), and a claim bound to it; the
run's Pod then mounts every folder as a `subPath` of the claim, no hostPath at all,
and the runner reads what the step wrote from the same folder. Both objects are
deleted at the end (the volume is `Retain`: deleting it leaves the folder).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from sandbox.backends.choose import connect_backend
from sandbox.contracts.record import RunStatus
from sandbox.hostfs import hostmount
from testbed.kubernetes.cluster import Cluster
from testbed.kubernetes.fleetsetup import claim_settings
from tests.conftest import ThreadedRun, tree_digest, write_workflow
from tests.kubernetes.pods import no_pods_or_secrets, pod_of

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

CLAIM_STEP = r"""
import os, sqlite3, time
print("workflow:", open("/workflow/workflow.toml").read().splitlines()[0], flush=True)
con = sqlite3.connect(os.environ["DB_PATH"])
con.execute("INSERT INTO t VALUES (2, 'from the step')")
con.commit()
with open("written-through-the-claim.txt", "w") as handle:
    handle.write("hello")
open("ready", "w").close()
deadline = time.monotonic() + 240
while not os.path.exists("go") and time.monotonic() < deadline:
    time.sleep(0.05)
print("released", flush=True)
"""


def _ownership(root: Path) -> dict[str, tuple[int, int, int]]:
    """Path -> (uid, gid, mode) of the tree, links not followed (test runs left out)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if os.path.relpath(dirpath, root) == ".":
            dirnames[:] = [d for d in dirnames if d != "runs"]  # the test runs' own
        for name in [*dirnames, *filenames, "."]:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (
                st.st_uid,
                st.st_gid,
                st.st_mode,
            )
    return out


def test_the_run_folder_is_mounted_from_the_claim_by_subpath(
    kube_cluster: Cluster,
    kube_core: Any,
    kube_namespace: str,
    claim: tuple[str, Path],
) -> None:
    name, root = claim
    settings = claim_settings(kube_cluster, kube_namespace, name, root)
    wf = write_workflow(root, command=["python3", "/workflow/code/step.py"], timeout_s=300)
    (wf / "code" / "step.py").write_text(CLAIM_STEP)
    before, owners = tree_digest(wf), _ownership(wf)
    with ThreadedRun(wf, backend=lambda: connect_backend(settings)) as run:
        ready = run.wait_for_in_group("ready")
        try:
            pod = pod_of(kube_core, kube_namespace, run.layout.run_id)
        finally:
            (ready.parent / "go").touch()  # the step ends whatever is asserted below
    volumes = {v.name: v for v in pod.spec.volumes}
    assert volumes["storage"].persistent_volume_claim.claim_name == name
    assert not [v.name for v in pod.spec.volumes if v.host_path is not None]
    assert pod.spec.security_context.fs_group is None  # never re-own the claim
    step = next(c for c in pod.spec.containers if c.name == "step")
    subpaths = {m.mount_path: (m.sub_path, bool(m.read_only)) for m in step.volume_mounts}
    assert subpaths["/workflow"][1] is True and subpaths["/workflow"][0].endswith(".view")
    assert subpaths["/test/g"] == (str(run.layout.disk_group.relative_to(root)), False)
    record = run.record
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text[-2000:])
    assert record.node in kube_cluster.node_names
    log = record.stdout.text + record.stderr.text
    assert 'workflow: name = "wf"' in log and "released" in log
    # What the step wrote through the claim is what the runner reads on the host.
    assert "written-through-the-claim.txt" in record.files.created
    group = wf / "runs" / record.id / "g" / "written-through-the-claim.txt"
    assert group.read_text() == "hello"
    assert record.db_diff is not None
    assert {t.name: t.inserted for t in record.db_diff.tables}.get("t") == 1
    assert tree_digest(wf) == before
    assert _ownership(wf) == owners
    assert not hostmount.mounts_below(wf)
    no_pods_or_secrets(kube_core, kube_namespace)
