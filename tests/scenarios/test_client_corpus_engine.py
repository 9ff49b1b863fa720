"""The rest of the client corpus against the real engine: Python's `requests` and
`httpx` with their default settings, Go's `net/http` (a static binary built here), and
`git` over HTTPS with its smart protocol against a real git server in the fake outside
world. Each one's reads arrive, its effects are stubbed and never arrive, other hosts
are recorded under their names, and no DNS query leaves the run."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest
from docker import DockerClient
from docker.models.containers import Container

from sandbox.contracts.names import STEP_IMAGE
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.contracts.wire import ActionLine
from sandbox.policy import stub_reply
from sandbox.run.testrun import RunOptions, TestRun
from tests import paths
from tests.conftest import WorkflowFactory, call_lines, tree_digest
from tests.fakes.harness import ALIAS, Outside, outside_server, tls_files
from tests.polling import wait_for
from tests.scenarios.egressparts import fake_resolver

pytestmark = pytest.mark.engine

POST_STUB = stub_reply("HTTP POST", "HTTP POST can have effects; only GET and HEAD pass")
PUSH_REASON = "git push (git-receive-pack) changes the repository; only fetches pass"


@pytest.fixture
def outside(engine: DockerClient) -> Iterator[Outside]:
    with outside_server(engine) as server:
        yield server


def run_in_step(
    make_workflow: WorkflowFactory,
    outside: Outside,
    source: str,
    egress_toml: str,
    files: dict[str, bytes],
) -> tuple[TestRunRecord, dict[str, Any], list[ActionLine]]:
    """Run `source` as the step with `files` beside it in the workflow folder (a CA, a
    binary: executable when it starts with ELF's magic); the record, the step's last
    stdout line as JSON, and the action log's calls."""
    wf = make_workflow(
        command=["python3", "/workflow/code/step.py"],
        extra_toml=egress_toml,
        db_sql=None,
        timeout_s=180,
    )
    (wf / "code" / "step.py").write_text(textwrap.dedent(source))
    for name, data in files.items():
        (wf / name).write_bytes(data)
        (wf / name).chmod(0o755 if data.startswith(b"\x7fELF") else 0o644)
    before = tree_digest(wf)
    record = TestRun(wf, "step1", RunOptions(upstream_networks=(outside.network,))).execute()
    assert tree_digest(wf) == before
    lines = call_lines(wf / "runs" / record.id / "test_mode_actions.jsonl")
    text = record.stdout.text.strip()
    out = json.loads(text.splitlines()[-1]) if text else {}
    return record, out, lines


# --------------------------------------------------------------------------- HTTP clients

GO_CLIENT = """
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"
)

func main() {
	method, url := os.Args[1], os.Args[2]
	var body io.Reader
	if method == "POST" {
		body = strings.NewReader("secret-post-body")
	}
	req, err := http.NewRequest(method, url, body)
	if err == nil {
		var resp *http.Response
		// http.DefaultTransport: the proxy variables when set, the system's resolver
		resp, err = (&http.Client{Timeout: 20 * time.Second}).Do(req)
		if err == nil {
			defer resp.Body.Close()
			data, _ := io.ReadAll(resp.Body)
			out, _ := json.Marshal([]any{resp.StatusCode, string(data)})
			fmt.Println(string(out))
			return
		}
	}
	out, _ := json.Marshal([]any{0, err.Error()})
	fmt.Println(string(out))
}
"""


@pytest.fixture(scope="module")
def go_client(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Go's net/http client as a static binary (no cgo: Go's own resolver, no libc)."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("`go` is not installed on this host: the Go client cannot be built")
    folder = tmp_path_factory.mktemp("goclient")
    (folder / "main.go").write_text(GO_CLIENT)
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(folder),
        "CGO_ENABLED": "0",
        "GOCACHE": str(folder / "cache"),
        "GOPATH": str(folder / "gopath"),
        "GOPROXY": "off",
        "GOTOOLCHAIN": "local",
        "GO111MODULE": "off",
    }
    subprocess.run(
        [go, "build", "-o", str(folder / "goclient"), "main.go"],
        cwd=folder,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return (folder / "goclient").read_bytes()


CLIENTS = r"""
import json, os, subprocess
BARE = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
REQUESTS = '''
import json, sys, requests
method, url = sys.argv[1:]
data = b"secret-post-body" if method == "POST" else None
r = requests.request(method, url, data=data, timeout=20)
print(json.dumps([r.status_code, r.text]))
'''
HTTPX = '''
import json, sys, httpx
method, url = sys.argv[1:]
content = b"secret-post-body" if method == "POST" else None
r = httpx.request(method, url, content=content, timeout=20)
print(json.dumps([r.status_code, r.text]))
'''
def run(argv, env):
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    text = done.stdout.strip()
    return json.loads(text.splitlines()[-1]) if text else [0, done.stderr[-300:]]
clients = {
    "requests": ["python3", "-c", REQUESTS],
    "httpx": ["python3", "-c", HTTPX],
    "go": ["/workflow/goclient"],
}
out = {}
for name, argv in clients.items():
    # as the step's environment has it (the proxy variables set), and without them
    for mode, env in (("proxy", dict(os.environ)), ("direct", BARE)):
        key = f"{name}-{mode}"
        out[key] = {
            "get": run([*argv, "GET", f"http://outside.test:8080/page-{key}"], env),
            "post": run([*argv, "POST", f"http://outside.test:8080/effect-{key}"], env),
            "other": run([*argv, "GET", f"http://not-allowed-{key}.test:8080/x"], env),
        }
print(json.dumps(out))
"""

EGRESS_TOML = """
[egress]
allow = [{ host = "outside.test", port = 8080 }]
"""


def test_requests_httpx_and_go_read_through_the_guard_either_way(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside, go_client: bytes
) -> None:
    with fake_resolver(engine, outside.network) as resolver:
        record, out, lines = run_in_step(
            make_workflow, outside, CLIENTS, EGRESS_TOML, {"goclient": go_client}
        )
        assert record.status is RunStatus.PASSED, record.stderr.text
        assert resolver.queries() == []  # no lookup reached the outside resolver
    keys = [f"{n}-{m}" for n in ("requests", "httpx", "go") for m in ("proxy", "direct")]
    http = [ln for ln in lines if ln.tool == "http"]
    for key in keys:
        got = out[key]
        assert got["get"] == [200, f"hello from outside /page-{key}"], (key, got)
        assert got["post"][0] == 403 and got["post"][1].strip() == POST_STUB, (key, got)
        host = f"not-allowed-{key}.test"
        assert got["other"][0] == 403 and "not on the egress allow list" in got["other"][1]
        assert record.egress[host].stubbed == 1, key
        # Each way the step came is the one its line names.
        mine = [ln for ln in http if key in ln.arguments["url"]]
        assert len(mine) == 3, (key, mine)
        assert {ln.detail["via"] for ln in mine} == {key.rsplit("-", 1)[1]}, key
        post = next(ln for ln in mine if ln.arguments["method"] == "POST")
        assert post.decision == "stub" and post.arguments["body_bytes"] == len("secret-post-body")
    # The outside world saw exactly the reads.
    seen = [(s["method"], s["path"]) for s in outside.seen() if s["proto"] == "http"]
    assert sorted(seen) == sorted(("GET", f"/page-{key}") for key in keys)
    assert record.egress[ALIAS].passed == len(keys)
    assert record.egress[ALIAS].stubbed == len(keys)


# --------------------------------------------------------------------------- git


GIT_ALIAS = "git.test"
GIT_SERVER = paths.TESTS / "fakes" / "git_https_server.py"


@dataclass(frozen=True)
class GitHost:
    container: Container
    ca_pem: str

    def requests(self) -> list[tuple[str, str, str]]:
        """(method, path, content type) of every request that arrived, in order."""
        out = []
        for line in self.container.logs().decode().splitlines():
            if line.startswith("request "):
                _, method, path, content_type, _size = line.split(" ")
                out.append((method, path, content_type))
        return out

    def refs(self) -> str:
        done = self.container.exec_run(
            ["git", "-C", "/tmp/srv/repo.git", "for-each-ref"], user="10001:10001"
        )
        assert done.exit_code == 0 and isinstance(done.output, bytes), done.output
        return done.output.decode()


@pytest.fixture
def git_host(engine: DockerClient, outside: Outside) -> Iterator[GitHost]:
    """git http-backend behind TLS (port 8443) on the outside network, as `git.test`."""
    tls_dir = Path(tempfile.mkdtemp(prefix="sandbox-fake-git-tls-"))
    ca_pem = tls_files(tls_dir, GIT_ALIAS)
    network = outside.network
    container = engine.containers.run(
        STEP_IMAGE,
        ["python3", "/srv/git_https_server.py"],
        name=f"sandbox-fake-git-{secrets.token_hex(4)}",
        user="10001:10001",
        labels={"sandbox.fake": "1"},
        mounts=[
            docker.types.Mount(
                "/srv/git_https_server.py", str(GIT_SERVER), type="bind", read_only=True
            ),
            docker.types.Mount("/srv/tls", str(tls_dir), type="bind", read_only=True),
        ],
        network=network,
        networking_config={network: engine.api.create_endpoint_config(aliases=[GIT_ALIAS])},
        detach=True,
    )
    try:
        wait_for(lambda: b"ready" in container.logs(), 60, "the fake git host")
        yield GitHost(container, ca_pem)
    finally:
        container.remove(force=True)
        shutil.rmtree(tls_dir, ignore_errors=True)


GIT_STEP = r"""
import json, os, subprocess
BARE = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
BARE |= {"HOME": "/tmp", "GIT_TERMINAL_PROMPT": "0"}
PROXIED = dict(os.environ, HOME="/tmp", GIT_TERMINAL_PROMPT="0")
URL = "https://git.test:8443/repo.git"
def git(*args, env=BARE, cwd="/tmp"):
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=60)
    except subprocess.TimeoutExpired as exc:
        return [-1, f"timed out: {(exc.stderr or b'')[-1500:]!r}"]
    return [done.returncode, done.stderr[-1500:]]
def readme(folder):
    try:
        return open(f"{folder}/README").read()
    except OSError:
        return None
def curl(path, content_type):
    done = subprocess.run(["curl", "-sS", "--noproxy", "*", "--max-time", "20", "-X", "POST",
                           "-H", f"Content-Type: {content_type}", "--data-binary", "0000",
                           "-w", "\n%{http_code}", URL + path], capture_output=True, text=True)
    body, _, code = done.stdout.rpartition("\n")
    return [int(code or 0), body]
out = {}
out["clone_direct"] = git("clone", "-q", URL, "/tmp/direct")
out["readme_direct"] = readme("/tmp/direct")
out["clone_proxy"] = git("clone", "-q", URL, "/tmp/proxied", env=PROXIED)
out["readme_proxy"] = readme("/tmp/proxied")
if out["readme_direct"] is not None:
    with open("/tmp/direct/EFFECT", "w") as handle:
        handle.write("pushed\n")
    git("add", "EFFECT", cwd="/tmp/direct")
    git("-c", "user.name=s", "-c", "user.email=s@t", "commit", "-qm", "effect", cwd="/tmp/direct")
    out["push"] = git("push", "origin", "HEAD:main", cwd="/tmp/direct")
out["abuse_type"] = curl("/git-upload-pack", "application/json")
out["abuse_path"] = curl("/git-upload-pack/x", "application/x-git-upload-pack-request")
print(json.dumps(out))
"""

GIT_TOML = f"""
[egress]
trust_ca_files = ["git-ca.pem"]
allow = [{{ host = "{GIT_ALIAS}", port = 8443, tls = true }}]
"""


def test_git_clones_over_smart_https_and_a_push_is_stubbed_and_never_arrives(
    engine: DockerClient, make_workflow: WorkflowFactory, outside: Outside, git_host: GitHost
) -> None:
    refs_before = git_host.refs()
    with fake_resolver(engine, outside.network) as resolver:
        record, out, lines = run_in_step(
            make_workflow, outside, GIT_STEP, GIT_TOML, {"git-ca.pem": git_host.ca_pem.encode()}
        )
        assert record.status is RunStatus.PASSED, record.stderr.text
        assert resolver.queries() == []
    # The clone works both ways the step can come, content and all (else: what the
    # guard decided and what the git host saw).
    seen = [f"{ln.decision} {ln.arguments.get('method')} {ln.arguments.get('url')}" for ln in lines]
    assert out["clone_direct"][0] == 0, (out, seen, git_host.container.logs().decode())
    assert out["readme_direct"] == "hello-from-git\n"
    assert out["clone_proxy"][0] == 0, out
    assert out["readme_proxy"] == "hello-from-git\n"
    # The push is stubbed: git fails, the repository is as it was, nothing arrived.
    assert out["push"][0] != 0 and "403" in out["push"][1], out
    assert git_host.refs() == refs_before
    for name in ("abuse_type", "abuse_path"):
        assert out[name][0] == 403 and out[name][1].strip() == POST_STUB, (name, out[name])
    arrived = git_host.requests()
    fetch_type = "application/x-git-upload-pack-request"
    assert ("POST", "/repo.git/git-upload-pack", fetch_type) in arrived
    for method, path, content_type in arrived:  # reads only: GETs and fetches
        assert method == "GET" or (
            (method, path, content_type) == ("POST", "/repo.git/git-upload-pack", fetch_type)
        ), (method, path, content_type)
    http = [ln for ln in lines if ln.tool == "http"]
    fetches = [ln for ln in http if ln.arguments["method"] == "POST" and ln.decision == "allow"]
    assert fetches and all(ln.detail["git"] == "upload-pack" for ln in fetches)
    assert {ln.detail["via"] for ln in fetches} == {"direct", "proxy"}
    assert all(ln.detail["tls"] == "inspected" for ln in fetches)
    pushes = [ln for ln in http if ln.arguments["url"].endswith("/git-receive-pack")]
    assert pushes and all(ln.decision == "stub" for ln in pushes)
    assert all(ln.reason == PUSH_REASON and ln.detail["git"] == "receive-pack" for ln in pushes)
    assert record.egress[GIT_ALIAS].stubbed == len(pushes) + 2
