"""The MCP proxy against the real engine and real, published MCP servers.

The servers are the ones installed in the MCP image (`images/mcp/mcp-servers.txt`), each
run by the sandbox in a container of its own:
from PyPI `mcp-server-time` and `mcp-server-git`, from npm the reference
`server-filesystem`, `server-memory` and `server-everything`, and
`@ivotoby/openapi-mcp-server` (an OpenAPI-to-MCP server that declares no
annotations at all). The step speaks MCP through the guard with the stdlib
helper `agentworks_mcp` (the step image has no SDK).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import jsonschema
import pytest
from docker import DockerClient
from docker.models.containers import Container

from sandbox.contracts import names
from sandbox.contracts.config import DEFAULT_LOOKUP_BUDGET_S
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.contracts.wire import ActionLine
from sandbox.launch.specs import MCP_SERVER_PATH
from sandbox.policy import stub_reply
from sandbox.run.testrun import RunOptions, TestRun
from tests import paths
from tests.conftest import ThreadedRun, WorkflowFactory, tree_digest

sys.path.insert(0, str(paths.REPO / "examples" / "job-board" / "fake_api"))
from harness import FAKE_LABEL, FakeJobBoard, fake_jobboard

pytestmark = pytest.mark.engine

# What a stdio server's environment may hold besides its own `env`/`env_from_host`.
# (HOSTNAME is the engine's: the container's id.)
SERVER_ENV_KEYS = {
    "PATH",
    "HOME",
    "LANG",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONUNBUFFERED",
    "HOSTNAME",
}

NOTES = "Job 42: senior Python role, budget 3000 USD.\n"
GRAPH = [
    {"type": "entity", "name": "Acme", "entityType": "client", "observations": ["pays on time"]},
    {"type": "entity", "name": "Job42", "entityType": "job", "observations": ["python"]},
    {"type": "relation", "from": "Acme", "to": "Job42", "relationType": "posted"},
]
COMMIT_MESSAGE = "Add the proposal template"
# git refuses a repository owned by another uid unless told it is safe: the owner's config.
GIT_SAFE = (
    '{ GIT_CONFIG_COUNT = "1", GIT_CONFIG_KEY_0 = "safe.directory", GIT_CONFIG_VALUE_0 = "*" }'
)

STDIO_SERVERS = f"""
[[mcp_servers]]
name = "files"
command = ["mcp-server-filesystem", "/workflow/files"]

[[mcp_servers]]
name = "memory"
command = ["mcp-server-memory"]
env = {{ MEMORY_FILE_PATH = "/workflow/memory/graph.jsonl" }}

[[mcp_servers]]
name = "git"
command = ["mcp-server-git", "--repository", "/workflow/repo"]
env = {GIT_SAFE}

[[mcp_servers]]
name = "time"
command = ["mcp-server-time", "--local-timezone", "UTC"]

[[mcp_servers]]
name = "everything"
command = ["mcp-server-everything"]
read_only_overrides = {{ "get-env" = false }}
"""

READS_AND_WRITES_STEP = """
import json, os, pathlib, socket
import agentworks_mcp as mcp

out = {"servers": mcp.servers()}

def call(session, key, tool, args):
    out[key] = session.call_tool(tool, args)

with mcp.connect("files") as s:
    out["files_tools"] = s.list_tools()
    call(s, "files_read", "read_text_file", {"path": "/workflow/files/notes.txt"})
    call(s, "files_list", "list_directory", {"path": "/workflow/files"})
    call(s, "files_write", "write_file", {"path": "/workflow/files/notes.txt", "content": "gone"})
    call(s, "files_move", "move_file", {"source": "/workflow/files/notes.txt", "destination": "/workflow/files/x.txt"})
    call(s, "files_unlisted", "no_such_tool", {})
    try:
        s.request("logging/setLevel", {"level": "debug"})
    except mcp.McpError as exc:
        out["files_refused"] = [exc.code, str(exc)]

with mcp.connect("memory") as s:
    out["memory_tools"] = s.list_tools()
    call(s, "memory_read", "read_graph", {})
    call(s, "memory_create", "create_entities", {"entities": [{"name": "Evil", "entityType": "x", "observations": []}]})
    call(s, "memory_delete", "delete_entities", {"entityNames": ["Acme"]})

with mcp.connect("git") as s:
    repo = {"repo_path": "/workflow/repo"}
    call(s, "git_log", "git_log", repo)
    call(s, "git_status", "git_status", repo)
    call(s, "git_commit", "git_commit", {**repo, "message": "sneaky"})
    call(s, "git_reset", "git_reset", repo)
    call(s, "git_branch", "git_create_branch", {**repo, "branch_name": "evil"})

with mcp.connect("time") as s:
    out["time_tools"] = s.list_tools()
    call(s, "time_now", "get_current_time", {"timezone": "UTC"})

with mcp.connect("everything") as s:
    out["everything_tools"] = [t["name"] for t in s.list_tools()]
    resources = s.request("resources/list", {})["resources"]
    out["resource_uri"] = resources[0]["uri"]
    out["resource"] = s.read_resource(resources[0]["uri"])
    prompts = s.request("prompts/list", {})["prompts"]
    simple = next(p for p in prompts if not any(a.get("required") for a in p.get("arguments", [])))
    out["prompt"] = s.get_prompt(simple["name"])
    call(s, "env", "get-env", {})
    call(s, "echo", "echo", {"message": "hello through the guard"})

# What the step can see of the servers, other than through the guard.
cmdlines = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            cmdlines.append(pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"))
        except OSError:
            pass
out["cmdlines"] = cmdlines
out["seen_paths"] = [p for p in ("/guard", "/guard/data", "/opt/mcp") if os.path.exists(p)]
# The run root is a folder of the real workflow folder, which the step's view leaves out.
guard_dir = "/workflow/runs/" + os.environ["AGENTWORKS_TEST_RUN_ID"] + "/guard"
stderr_dir = "/workflow/runs/" + os.environ["AGENTWORKS_TEST_RUN_ID"] + "/mcp-stderr"
for probe in (lambda: os.listdir(guard_dir), lambda: os.listdir(stderr_dir)):
    try:
        probe()
        out.setdefault("guard_dir", []).append("readable")
    except OSError as exc:
        out.setdefault("guard_dir", []).append(type(exc).__name__)
json.dump(out, open("out.json", "w"))
"""


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=Owner", "-c", "user.email=owner@example.invalid", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


def _seed_data(wf: Path) -> None:
    (wf / "files").mkdir()
    (wf / "files" / "notes.txt").write_text(NOTES)
    (wf / "memory").mkdir()
    (wf / "memory" / "graph.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GRAPH))
    repo = wf / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "template.md").write_text("Dear client,\n")
    _git(repo, "add", "template.md")
    _git(repo, "commit", "-q", "-m", COMMIT_MESSAGE)
    (repo / "template.md").write_text("Dear client, (draft)\n")  # an unstaged change


def _lines(record: TestRunRecord) -> list[ActionLine]:
    path = Path(record.workflow_dir) / "runs" / record.id / "test_mode_actions.jsonl"
    return [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]


def _by_tool(lines: list[ActionLine]) -> dict[str, list[ActionLine]]:
    """Each call's first line (a forwarded call's start line), by tool."""
    out: dict[str, list[ActionLine]] = {}
    for line in lines:
        if line.event != "outcome":
            out.setdefault(line.tool, []).append(line)
    return out


def _text(result: dict[str, Any]) -> str:
    return "\n".join(
        b.get("text", "") for b in result.get("content", []) if b.get("type") == "text"
    )


def _assert_stub(result: dict[str, Any], line: ActionLine, tool: str) -> None:
    assert line.decision == "stub", (tool, line)
    assert result.get("isError") is False
    assert _text(result) == stub_reply(tool, line.reason)


def test_real_servers_reads_pass_writes_are_stubbed_and_data_is_unchanged(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command=["python3", "/workflow/code/step.py"], extra_toml=STDIO_SERVERS)
    (wf / "code" / "step.py").write_text(textwrap.dedent(READS_AND_WRITES_STEP))
    _seed_data(wf)
    before = tree_digest(wf)
    record = TestRun(wf, "step1").execute()
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    assert tree_digest(wf) == before  # files, graph, repo: byte for byte
    run_root = wf / "runs" / record.id
    out = json.loads((run_root / "g" / "out.json").read_text())
    log = _by_tool(_lines(record))
    assert out["servers"] == ["files", "memory", "git", "time", "everything"]

    # filesystem (npm): reads real, writes stubbed with schema-valid structured content
    file_tools = {t["name"]: t for t in out["files_tools"]}
    assert len(file_tools) == 14  # tools/list shows every tool, writes included
    assert file_tools["read_text_file"]["annotations"] == {
        "readOnlyHint": True,
        "openWorldHint": False,
    }
    assert out["files_read"]["structuredContent"] == {"content": NOTES}
    assert "notes.txt" in _text(out["files_list"])
    (read_line,) = log["mcp:files/read_text_file"]
    assert read_line.decision == "allow" and read_line.category == "mcp"
    assert read_line.detail["annotations"] == {"readOnlyHint": True, "openWorldHint": False}
    assert read_line.detail["server"] == "files" and read_line.detail["tool"] == "read_text_file"
    for key, tool in (("files_write", "write_file"), ("files_move", "move_file")):
        (line,) = log[f"mcp:files/{tool}"]
        _assert_stub(out[key], line, tool)
        assert line.reason == "the server does not mark this tool read-only"
        assert line.detail["annotations"]["destructiveHint"] is True
        jsonschema.validate(out[key]["structuredContent"], file_tools[tool]["outputSchema"])
        assert line.detail["structured_content_valid"] is True
    (unlisted,) = log["mcp:files/no_such_tool"]
    _assert_stub(out["files_unlisted"], unlisted, "no_such_tool")
    assert unlisted.reason == "the server does not list this tool"
    assert out["files_refused"][0] == -32601
    assert log["mcp:files/logging/setLevel"][0].decision == "refuse"

    # memory (npm): the graph is read for real; creating and deleting are stubbed
    memory_tools = {t["name"]: t for t in out["memory_tools"]}
    graph = out["memory_read"]["structuredContent"]
    assert [e["name"] for e in graph["entities"]] == ["Acme", "Job42"]
    assert graph["relations"] == [{"from": "Acme", "to": "Job42", "relationType": "posted"}]
    for key, tool in (("memory_create", "create_entities"), ("memory_delete", "delete_entities")):
        (line,) = log[f"mcp:memory/{tool}"]
        _assert_stub(out[key], line, tool)
        jsonschema.validate(out[key]["structuredContent"], memory_tools[tool]["outputSchema"])
    assert log["mcp:memory/delete_entities"][0].detail["annotations"]["destructiveHint"] is True

    # git (PyPI): log and status are real; commit, reset, branch are stubbed
    assert COMMIT_MESSAGE in _text(out["git_log"])
    assert "template.md" in _text(out["git_status"])
    for key, tool in (("git_commit", "git_commit"), ("git_reset", "git_reset")):
        _assert_stub(out[key], log[f"mcp:git/{tool}"][0], tool)
    _assert_stub(out["git_branch"], log["mcp:git/git_create_branch"][0], "git_create_branch")

    # time (PyPI): a read-only tool with an output schema, relayed unchanged
    assert out["time_now"]["structuredContent"]["timezone"] == "UTC"
    assert out["time_now"]["isError"] is False

    # everything (npm): resources and prompts are reads; the guard advertised no roots,
    # sampling or elicitation, so the server registered none of its tools that need them
    assert "echo" in out["everything_tools"]
    for needs_client_capability in (
        "get-roots-list",
        "trigger-sampling-request",
        "trigger-elicitation-request",
    ):
        assert needs_client_capability not in out["everything_tools"]
    assert out["resource"]["contents"][0]["uri"] == out["resource_uri"]
    assert out["prompt"]["messages"]
    assert log["mcp:everything/resources/read"][0].decision == "allow"
    assert log["mcp:everything/prompts/get"][0].decision == "allow"
    assert "hello through the guard" in _text(out["echo"])
    # get-env says readOnlyHint: true, but the owner's override says no: stubbed, recorded
    (env_line,) = log["mcp:everything/get-env"]
    _assert_stub(out["env"], env_line, "get-env")
    assert env_line.reason == "owner override marks it not read-only"
    assert env_line.detail["override"] == {"read_only": False}
    assert env_line.detail["annotations"]["readOnlyHint"] is True

    # one line per MCP call (a forwarded one: start, then outcome); the summary lists stubs
    tool_calls = [ln for ln in _lines(record) if ln.category == "mcp" and ln.event != "outcome"]
    assert len(tool_calls) == 19
    outcomes = [ln for ln in _lines(record) if ln.event == "outcome"]
    assert [ln.call_id for ln in tool_calls if ln.event == "start"] == [
        ln.call_id for ln in outcomes
    ]
    assert {s.tool for s in record.stubbed} >= {"mcp:files/write_file", "mcp:git/git_commit"}

    # the step saw no server process, no guard folder, no MCP install
    assert not [c for c in out["cmdlines"] if "mcp" in c or "node" in c]
    assert out["seen_paths"] == []
    # The step's view of the workflow folder has no test run folder at all: neither the
    # guard's folder nor the servers' stderr can even be named.
    assert out["guard_dir"] == ["FileNotFoundError", "FileNotFoundError"]
    # each stdio server's stderr, read back by the host into a folder only root can open
    assert (run_root / "mcp-stderr").stat().st_mode & 0o777 == 0o700
    for name in ("files", "memory", "git", "time", "everything"):
        stderr = run_root / "mcp-stderr" / f"{name}.log"
        assert stderr.stat().st_mode & 0o777 == 0o600 and stderr.stat().st_uid == 0
        report = record.mcp_servers[name]
        assert report.stderr_file == f"mcp-stderr/{name}.log"
        assert report.uid >= 10100
    assert len({r.uid for r in record.mcp_servers.values()}) == 5  # a uid each
    assert "Secure MCP Filesystem Server" in (run_root / "mcp-stderr" / "files.log").read_text()


# --------------------------------------------------------------------------- faults

FAULTS_STEP = """
import json, pathlib, time
import agentworks_mcp as mcp

def wait_for(name):
    deadline = time.monotonic() + 120
    while not pathlib.Path(name).exists():
        assert time.monotonic() < deadline, name
        time.sleep(0.05)

out = {}
with mcp.connect("memory") as memory, mcp.connect("time") as clock:
    out["before"] = memory.call_tool("read_graph", {})
    pathlib.Path("ready1").write_text("1"); wait_for("go1")
    started = time.monotonic()
    out["hung"] = memory.call_tool("read_graph", {})
    out["hung_s"] = time.monotonic() - started
    pathlib.Path("ready2").write_text("1"); wait_for("go2")
    out["dead"] = memory.call_tool("read_graph", {})
    out["dead_again"] = memory.call_tool("search_nodes", {"query": "Acme"})
    out["other_server"] = clock.call_tool("get_current_time", {"timezone": "UTC"})
json.dump(out, open("out.json", "w"))
"""


def _server_exec(server: Container, *cmd: str) -> str:
    """A command in a server's own container, as the server's own uid."""
    code, output = server.exec_run(list(cmd), user=server.attrs["Config"]["User"])
    assert code == 0, output
    assert isinstance(output, bytes)
    return output.decode()


def _server(client: DockerClient, run_id: str, name: str) -> Container:
    (server,) = client.containers.list(
        filters={"label": [f"sandbox.run-id={run_id}", f"sandbox.mcp-server={name}"]}
    )
    return server


HUNG_LOOKUP_BUDGET_S = 2.0  # below the 5 s default, so the test sees the server's own budget


def test_server_that_hangs_or_dies_is_stubbed_and_the_step_goes_on(
    engine: DockerClient, make_workflow: WorkflowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "mcp-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("SANDBOX_TEST_MEMORY_TOKEN", secret)
    wf = make_workflow(
        command=["python3", "/workflow/code/step.py"],
        extra_toml=textwrap.dedent(
            f"""
            [[mcp_servers]]
            name = "memory"
            command = ["mcp-server-memory"]
            env = {{ MEMORY_FILE_PATH = "/workflow/memory/graph.jsonl" }}
            env_from_host = ["SANDBOX_TEST_MEMORY_TOKEN"]
            lookup_budget_s = {HUNG_LOOKUP_BUDGET_S}

            [[mcp_servers]]
            name = "time"
            command = ["mcp-server-time"]
            """
        ),
    )
    (wf / "code" / "step.py").write_text(textwrap.dedent(FAULTS_STEP))
    (wf / "memory").mkdir()
    (wf / "memory" / "graph.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GRAPH))

    with ThreadedRun(wf) as run:
        ready1 = run.wait_for_in_group("ready1")
        server = _server(engine, run.layout.run_id, "memory")
        ps = _server_exec(server, "ps", "-eo", "pid=,args=")
        (pid,) = [
            ln.split()[0]
            for ln in ps.splitlines()
            if "mcp-server-memory" in ln and "relay" not in ln
        ]
        # The server's own environment: its credential, a minimal PATH, nothing of the guard's.
        environ = _server_exec(server, "cat", f"/proc/{pid}/environ").split("\0")
        env = dict(item.split("=", 1) for item in environ if "=" in item)
        assert env["SANDBOX_TEST_MEMORY_TOKEN"] == secret
        assert env["PATH"] == MCP_SERVER_PATH
        assert env["HOME"] == "/tmp"
        assert set(env) <= {*SERVER_ENV_KEYS, "MEMORY_FILE_PATH", "SANDBOX_TEST_MEMORY_TOKEN"}
        # Its credential is nowhere in the guard's container.
        guard = run.guard(engine, run.layout.run_id)
        assert secret not in json.dumps(guard.attrs["Config"])
        _server_exec(server, "kill", "-STOP", pid)  # the server hangs
        (ready1.parent / "go1").write_text("1")
        ready2 = run.wait_for_in_group("ready2")
        _server_exec(server, "kill", "-KILL", pid)  # the server dies
        (ready2.parent / "go2").write_text("1")
    record = run.record
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    out = json.loads((wf / "runs" / record.id / "g" / "out.json").read_text())
    lines = [ln for ln in _lines(record) if ln.category == "mcp" and ln.event != "outcome"]
    assert [ln.tool for ln in lines] == [
        "mcp:memory/read_graph",
        "mcp:memory/read_graph",
        "mcp:memory/read_graph",
        "mcp:memory/search_nodes",
        "mcp:time/get_current_time",
    ]
    assert [ln.decision for ln in lines] == ["allow", "stub", "stub", "stub", "allow"]
    assert [e["name"] for e in out["before"]["structuredContent"]["entities"]] == ["Acme", "Job42"]
    hung, dead, dead_again = lines[1], lines[2], lines[3]
    assert hung.reason.startswith("annotation lookup failed: ")
    # The server's own lookup budget, not the default, decided when the call was stubbed.
    assert f"{HUNG_LOOKUP_BUDGET_S:g} s" in hung.reason
    assert HUNG_LOOKUP_BUDGET_S - 0.5 < out["hung_s"] < DEFAULT_LOOKUP_BUDGET_S
    assert "closed the connection" in dead.reason
    assert "not running" in dead_again.reason
    for key, line, tool in (
        ("hung", hung, "read_graph"),
        ("dead", dead, "read_graph"),
        ("dead_again", dead_again, "search_nodes"),
    ):
        _assert_stub(out[key], line, tool)
        assert line.detail["listed"] is False and line.detail["annotations"] is None
    assert out["other_server"]["structuredContent"]["timezone"] == "UTC"
    # The secret never reached the step, its output or the record.
    run_root = wf / "runs" / record.id
    assert secret not in record.stdout.text + record.stderr.text
    assert secret not in (run_root / "test_mode_actions.jsonl").read_text()


# --------------------------------------------------------------------------- HTTP servers

JOBS_API = "jobapi"
JOBS_PORT = 3000


def _spec(*, version: int) -> str:
    paths: dict[str, Any] = {
        "/health": {
            "get": {"operationId": "getHealth", "responses": {"200": {"description": "ok"}}}
        }
    }
    if version >= 2:
        paths["/state"] = {
            "get": {"operationId": "getState", "responses": {"200": {"description": "ok"}}}
        }
        paths["/v1/tools/call"] = {
            "post": {
                "operationId": "submitProposal",
                "requestBody": {
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "tool": {"type": "string"},
                                    "arguments": {"type": "object"},
                                },
                            }
                        }
                    }
                },
                "responses": {"200": {"description": "ok"}},
            }
        }
    return json.dumps(
        {
            "openapi": "3.0.0",
            "info": {"title": "job board", "version": str(version)},
            "paths": paths,
        }
    )


NODE_MODULES = "/opt/mcp/node/node_modules"


@contextlib.contextmanager
def openapi_server(engine: DockerClient, fake: FakeJobBoard, spec_dir: Path) -> Iterator[str]:
    """The OpenAPI MCP server behind supergateway (streamable HTTP), in its own container.

    supergateway's stateless mode starts the stdio server afresh for every HTTP
    request, and the OpenAPI server builds its tools from the spec file when it
    starts: a spec that gains an operation gives the running server a new tool."""
    server = (
        f"node {NODE_MODULES}/@ivotoby/openapi-mcp-server/bin/mcp-server.js"
        " --api-base-url http://jobboard:8080 --openapi-spec /spec/openapi.json"
    )
    container = engine.containers.run(
        names.MCP_IMAGE,
        entrypoint=["node", f"{NODE_MODULES}/supergateway/dist/index.js"],
        command=[
            "--stdio",
            server,
            "--outputTransport",
            "streamableHttp",
            "--port",
            str(JOBS_PORT),
            "--logLevel",
            "none",
        ],
        name=f"sandbox-test-openapi-{secrets.token_hex(4)}",
        user="10100:10100",
        labels={FAKE_LABEL: "1"},
        mounts=[docker.types.Mount("/spec", str(spec_dir), type="bind", read_only=True)],
        network=fake.network,
        networking_config={fake.network: engine.api.create_endpoint_config(aliases=[JOBS_API])},
        detach=True,
    )
    try:
        container.reload()
        address = container.attrs["NetworkSettings"]["Networks"][fake.network]["IPAddress"]
        end = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection((address, JOBS_PORT), 1):
                break
            assert time.monotonic() < end, container.logs().decode()[-2000:]
            time.sleep(0.05)
        yield address
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)


def _write_spec(spec_dir: Path, version: int) -> None:
    tmp = spec_dir / "openapi.json.tmp"
    tmp.write_text(_spec(version=version))
    tmp.chmod(0o644)
    tmp.rename(spec_dir / "openapi.json")  # atomic: a request sees the old or the new spec


@pytest.fixture
def fake(engine: DockerClient) -> Iterator[FakeJobBoard]:
    with fake_jobboard(engine) as board:
        yield board


HTTP_STEP = """
import json, pathlib, socket, sys, time, urllib.request
import agentworks_mcp as mcp

address = sys.argv[1]
def wait_for(name):
    deadline = time.monotonic() + 120
    while not pathlib.Path(name).exists():
        assert time.monotonic() < deadline, name
        time.sleep(0.05)

def direct(host):
    # A plain GET straight to the server: whoever takes the connection answers it.
    request = b"GET /state HTTP/1.1\\r\\nHost: %s:3000\\r\\nConnection: close\\r\\n\\r\\n"
    try:
        with socket.create_connection((host, 3000), timeout=10) as conn:
            conn.sendall(request % host.encode())
            conn.settimeout(10)
            return conn.recv(4096).decode(errors="replace")
    except OSError as exc:
        return type(exc).__name__ + ": " + str(exc)

out = {"direct_ip": direct(address), "direct_name": direct("jobapi")}
with mcp.connect("jobs") as jobs:
    out["tools1"] = [t["name"] for t in jobs.list_tools()]
    out["health1"] = jobs.call_tool("get-health", {})
    out["state1"] = jobs.call_tool("get-state", {})
    pathlib.Path("ready").write_text("1"); wait_for("go")
    out["state2"] = jobs.call_tool("get-state", {})
    out["tools2"] = [t["name"] for t in jobs.list_tools()]
    out["submit2"] = jobs.call_tool("submit-proposal", {"tool": "upwork_submit_proposal", "arguments": {"job_id": 42}})
json.dump(out, open("out.json", "w"))
"""


def test_http_server_tool_added_between_calls_is_judged_at_the_second_call(
    engine: DockerClient, make_workflow: WorkflowFactory, fake: FakeJobBoard, tmp_path: Path
) -> None:
    """A real server gains tools between two calls; the second call sees them.

    The OpenAPI MCP server (behind supergateway, over HTTP) declares no
    annotations on any tool. Between the step's two phases the API's spec gains
    `GET /state` and `POST /v1/tools/call`. `get-state` has an owner override
    marking it read-only: at the first call the server does not list it (stub);
    at the second the live listing has it (no annotations, override: allowed,
    the real API answers). The new POST tool is stubbed, and nothing reaches
    the job board's write endpoint.
    """
    spec_dir = tmp_path / "spec"
    spec_dir.mkdir()
    spec_dir.chmod(0o755)
    _write_spec(spec_dir, 1)
    wf = make_workflow(
        command=["python3", "/workflow/code/step.py"],
        extra_toml=textwrap.dedent(
            f"""
            [[mcp_servers]]
            name = "jobs"
            url = "http://{JOBS_API}:{JOBS_PORT}/mcp"
            read_only_overrides = {{ "get-state" = true }}
            # supergateway's stateless mode starts a node process per request: the
            # default 5 s lookup is too short for it on a loaded host.
            lookup_budget_s = 60
            """
        ),
    )
    (wf / "code" / "step.py").write_text(textwrap.dedent(HTTP_STEP))
    with openapi_server(engine, fake, spec_dir) as address:
        (wf / "workflow.toml").write_text(
            (wf / "workflow.toml")
            .read_text()
            .replace('"/workflow/code/step.py"]', f'"/workflow/code/step.py", "{address}"]')
        )
        with ThreadedRun(wf, RunOptions(upstream_networks=(fake.network,))) as run:
            ready = run.wait_for_in_group("ready")
            _write_spec(spec_dir, 2)  # the API gains two operations: the server, two tools
            (ready.parent / "go").write_text("1")
    record = run.record
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text)
    out = json.loads((wf / "runs" / record.id / "g" / "out.json").read_text())
    lines = [ln for ln in _lines(record) if ln.category == "mcp" and ln.event != "outcome"]

    # The step cannot reach the HTTP server, by address or by name, only the guard's
    # endpoint: its direct GETs land on the guard, which stubs them (the server is an MCP
    # server, not on the egress allow list) and records them.
    for key in ("direct_ip", "direct_name"):
        assert out[key].startswith("HTTP/1.1 403 "), out[key]
        assert "not on the egress allow list" in out[key], out[key]
    direct = [ln for ln in _lines(record) if ln.tool == "http"]
    assert [(ln.decision, ln.detail["via"], ln.detail["host"]) for ln in direct] == [
        ("stub", "direct", address),
        ("stub", "direct", JOBS_API),
    ]

    assert out["tools1"] == ["get-health"]
    assert out["tools2"] == ["get-health", "get-state", "submit-proposal"]
    health1, state1, state2, submit2 = lines
    _assert_stub(out["health1"], health1, "get-health")
    assert health1.reason == "the server does not mark this tool read-only"
    assert health1.detail["listed"] is True and health1.detail["annotations"] is None
    _assert_stub(out["state1"], state1, "get-state")
    assert state1.reason == "the server does not list this tool"
    assert state1.detail["override"] == {"read_only": True}
    # second call: listed now, no annotations, the owner's override -> allowed, real answer
    assert state2.decision == "allow" and state2.reason == "owner override marks it read-only"
    assert state2.detail["override"] == {"read_only": True}
    assert state2.detail["listed"] is True and state2.detail["annotations"] is None
    assert out["state2"].get("isError", False) is False  # relayed as the server sent it
    assert '"connects": 100' in _text(out["state2"]) or '"connects":100' in _text(out["state2"])
    _assert_stub(out["submit2"], submit2, "submit-proposal")
    assert submit2.reason == "the server does not mark this tool read-only"
    state = fake.state()
    assert state["proposals"] == [] and state["calls"] == [] and state["connects"] == 100
