"""Transparent egress on a Pod, as on Docker: the init container (root, NET_ADMIN, then
gone) installs the nat rules in the Pod's namespace, so a client that ignores the proxy
variables reaches the guard, and its lookups are answered by the guard's DNS. The step
holds no capability."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sandbox.backends import BackendFactory
from sandbox.contracts.record import RunStatus
from sandbox.run.testrun import RunOptions, TestRun
from tests.conftest import tree_digest, write_workflow
from tests.kubernetes.pods import (
    OUTSIDE_PORT,
    no_pods_or_secrets,
    outside_server_pod,
    start_server,
)

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(600)]

STEP = r"""
import json, os, socket, sys, urllib.error, urllib.request
for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
    os.environ.pop(var, None)
host, port = sys.argv[1], int(sys.argv[2])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def fetch(url, method="GET"):
    data = b"secret-post-body" if method == "POST" else None
    try:
        with opener.open(urllib.request.Request(url, data=data, method=method), timeout=20) as r:
            return [r.status, r.read().decode()[:300]]
    except urllib.error.HTTPError as exc:
        return [exc.code, exc.read().decode()[:300]]
    except OSError as exc:
        return [0, str(exc)]
out = {
    "get": fetch(f"http://{host}:{port}/etc/hostname"),
    "post": fetch(f"http://{host}:{port}/effect", "POST"),
    "other": fetch("http://not-allowed.test:8080/x"),
    "resolved": sorted({i[4][0] for i in socket.getaddrinfo("anything.test", 80)}),
}
status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
out["caps"] = [status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")]
print("OUT " + json.dumps(out), flush=True)
"""


def test_a_client_that_ignores_the_proxy_reads_through_the_guard_on_a_pod(
    kube_core: Any, kube_namespace: str, pods: BackendFactory, node_dir: Path
) -> None:
    outside_ip = start_server(kube_core, kube_namespace, outside_server_pod())
    wf = write_workflow(
        node_dir,
        command=["python3", "/workflow/code/step.py", outside_ip, str(OUTSIDE_PORT)],
        extra_toml=f'[egress]\nallow = [{{ host = "{outside_ip}", port = {OUTSIDE_PORT} }}]\n',
        db_sql=None,
    )
    (wf / "code" / "step.py").write_text(STEP)
    before = tree_digest(wf)
    record = TestRun(wf, "step1", RunOptions(), backend=pods).execute()
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    assert record.preflight is not None and record.preflight.ok, record.preflight
    line = next(ln for ln in record.stderr.text.splitlines() + record.stdout.text.splitlines()
                if ln.startswith("OUT "))  # fmt: skip
    out = json.loads(line[4:])
    assert out["get"] == [200, "outside\n"], out
    assert out["post"][0] == 403 and "TEST MODE" in out["post"][1], out
    assert out["other"][0] == 403 and "not on the egress allow list" in out["other"][1], out
    assert out["resolved"] and all(a.startswith("198.18.") for a in out["resolved"]), out
    assert all(int(v, 16) == 0 for v in out["caps"]), out["caps"]
    assert record.egress[outside_ip].passed == 1 and record.egress[outside_ip].direct >= 1
    assert record.egress[outside_ip].stubbed == 1
    assert record.egress["not-allowed.test"].stubbed == 1
    assert any(q.name == "anything.test" for q in record.dns.names)
    # The fake outside server saw the read and nothing else.
    served = kube_core.read_namespaced_pod_log("outside", kube_namespace)
    assert "GET /etc/hostname" in served and "POST" not in served and "/effect" not in served
    assert tree_digest(wf) == before
    no_pods_or_secrets(kube_core, kube_namespace)
