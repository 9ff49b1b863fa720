"""The job-board example's outside world, tested as a real process on loopback.

Why: engine tests treat the fake job-board API's `/state` as the evidence that
no effect of a test run reached the outside world. That evidence is only worth
something if the server records every call faithfully, answers reads, lets
writes change state, and starts and stops cleanly; this file proves that
without Docker. It also runs the example's step scripts on the host against a
stand-in bridge built from the real policy table and executor (not the guard,
and no isolation claimed), so a script bug shows up here first.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from examples.setup import ensure_db
from sandbox.contracts.config import load_workflow
from sandbox.contracts.wire import RUN_KIND_HEADER, ToolReply, ToolResult, UpstreamCall
from sandbox.policy import Decision, Route, decide, stub_reply
from sandbox.stepside.agentworks_exec.executor import Executor
from tests import paths

REPO = paths.REPO
EXAMPLE = REPO / "examples" / "job-board"
SERVER = EXAMPLE / "fake_api" / "server.py"
REAL_RUN = EXAMPLE / "runs" / "run-20261120T0800"
IDENTITY = {
    "run_id": "test-20261130T120000-abc123",
    "session": "s-1",
    "workflow": "job-board",
    "step": "bid-submit",
    "run_kind": "test",
}
START_DEADLINE_S = 10.0

# No proxy from the environment may sit between the tests and loopback.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(
    method: str,
    url: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 10.0,
) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Fake:
    proc: subprocess.Popen[bytes]
    url: str
    stderr_path: Path

    def call(
        self, tool: str, arguments: dict[str, Any], *, header: str | None = "test", **identity: Any
    ) -> dict[str, Any]:
        body = {"tool": tool, "arguments": arguments, **IDENTITY, **identity}
        headers = {RUN_KIND_HEADER: header} if header is not None else {}
        status, reply = _http("POST", self.url + "/v1/tools/call", body, headers=headers)
        assert status == 200, reply
        ToolResult.model_validate(reply)  # the guard parses replies with this model
        assert set(reply) == {"text", "data", "is_error"}
        return dict(reply)

    def state(self) -> dict[str, Any]:
        status, state = _http("GET", self.url + "/state")
        assert status == 200
        return dict(state)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=10)


def _start_fake(tmp_path: Path) -> Fake:
    """Start the server as a real subprocess (stdlib only: `-I -S`) and wait for /health."""
    last_error = "never started"
    for attempt in range(3):  # a port picked by bind(0) can be taken before the server binds it
        port = _free_port()
        stderr_path = tmp_path / f"fake-stderr-{port}-{attempt}.log"
        with stderr_path.open("wb") as stderr:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    str(SERVER),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        fake = Fake(proc, f"http://127.0.0.1:{port}", stderr_path)
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if _http("GET", fake.url + "/health", timeout=1.0)[0] == 200:
                    return fake
            except OSError as exc:
                last_error = str(exc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.05)  # poll interval that also notices an early exit
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        last_error = stderr_path.read_text() or last_error
    raise AssertionError(f"fake job-board API did not become healthy: {last_error}")


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Fake]:
    server = _start_fake(tmp_path)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=10)


# ----------------------------------------------------------------------- the server


def test_calls_are_recorded_with_identity_fields_and_the_run_kind_header(fake: Fake) -> None:
    reply = fake.call("web_fetch", {"url": "https://jobs.example.org/42"})
    assert reply["is_error"] is False
    assert reply["data"]["title"] == "Build a Flask dashboard"
    assert reply["data"]["budget"] == 500
    fake.call("web_fetch", {"url": "https://jobs.example.org/43"}, header=None, step="other")

    calls = fake.state()["calls"]
    assert len(calls) == 2
    first, second = calls
    assert first["tool"] == "web_fetch"
    assert first["arguments"] == {"url": "https://jobs.example.org/42"}
    assert {k: first[k] for k in IDENTITY} == IDENTITY
    assert first["run_kind_header"] == "test"
    assert second["run_kind_header"] is None
    assert second["step"] == "other"


def test_reads_answer_and_change_nothing(fake: Fake) -> None:
    assert "Flask" in fake.call("generate_text_llm", {"prompt": "write a proposal"})["text"]
    opened = fake.call("agent_browser", {"command": "open https://jobs.example.org/42"})
    assert "Build a Flask dashboard" in opened["text"]
    page = fake.call("agent_browser", {"command": "get text"})["text"]
    assert "Build a Flask dashboard" in page
    assert "$500" in page
    assert "Submit a proposal" in fake.call("agent_browser", {"command": "snapshot"})["text"]

    state = fake.state()
    assert [c["tool"] for c in state["calls"]] == ["generate_text_llm"] + ["agent_browser"] * 3
    assert state["proposals"] == state["messages"] == state["clicks"] == []
    assert state["connects"] == 100


def test_write_tools_change_state(fake: Fake) -> None:
    submitted = fake.call("upwork_submit_proposal", {"job_id": 42, "text": "Hello", "connects": 16})
    assert submitted["is_error"] is False
    assert submitted["data"] == {"proposal_id": 1, "connects_left": 84}
    fake.call("send_slack_message", {"channel": "@dana", "text": "hi"})
    fake.call("notify_user", {"text": "done"})
    fake.call("send_email", {"to": "a@example.org", "subject": "s", "body": "b"})
    fake.call("agent_browser", {"command": "click #submit"})
    fake.call("agent_browser", {"command": "fill #name Dana"})

    state = fake.state()
    assert state["connects"] == 84
    assert [(p["job_id"], p["connects"], p["run_id"]) for p in state["proposals"]] == [
        (42, 16, IDENTITY["run_id"])
    ]
    assert [m["tool"] for m in state["messages"]] == [
        "send_slack_message",
        "notify_user",
        "send_email",
    ]
    assert state["messages"][0]["arguments"] == {"channel": "@dana", "text": "hi"}
    assert [c["command"] for c in state["clicks"]] == ["click #submit", "fill #name Dana"]
    assert len(state["calls"]) == 6


def test_bad_write_is_an_error_and_changes_nothing(fake: Fake) -> None:
    too_many = fake.call("upwork_submit_proposal", {"job_id": 42, "text": "x", "connects": 101})
    assert too_many["is_error"] is True
    assert "Connects" in too_many["text"]
    assert fake.call("upwork_submit_proposal", {"job_id": 99, "text": "x", "connects": 1})[
        "is_error"
    ]
    state = fake.state()
    assert state["proposals"] == []
    assert state["connects"] == 100
    assert len(state["calls"]) == 2


def test_unknown_tool_is_an_error_and_still_recorded(fake: Fake) -> None:
    reply = fake.call("delete_everything", {"really": True})
    assert reply["is_error"] is True
    assert "unknown tool" in reply["text"]
    assert [c["tool"] for c in fake.state()["calls"]] == ["delete_everything"]


def test_malformed_call_is_400_and_still_recorded(fake: Fake) -> None:
    status, reply = _http(
        "POST", fake.url + "/v1/tools/call", raw=b"{not json", headers={RUN_KIND_HEADER: "test"}
    )
    assert status == 400
    assert "error" in reply
    calls = fake.state()["calls"]
    assert len(calls) == 1
    assert calls[0]["malformed"] is True
    assert calls[0]["run_kind_header"] == "test"


def test_reset_and_unknown_paths(fake: Fake) -> None:
    fake.call("notify_user", {"text": "x"})
    assert _http("POST", fake.url + "/reset", {})[0] == 200
    assert fake.state() == {
        "calls": [],
        "proposals": [],
        "messages": [],
        "clicks": [],
        "connects": 100,
    }
    assert _http("GET", fake.url + "/nope")[0] == 404
    assert _http("POST", fake.url + "/nope", {})[0] == 404


def test_slow_read_sleeps_while_the_server_stays_responsive(fake: Fake) -> None:
    replies: list[dict[str, Any]] = []
    started = time.monotonic()
    worker = threading.Thread(target=lambda: replies.append(fake.call("slow_read", {"seconds": 1})))
    worker.start()
    # Another request is answered while slow_read sleeps (one thread per request).
    health_started = time.monotonic()
    assert _http("GET", fake.url + "/health")[0] == 200
    assert time.monotonic() - health_started < 0.9
    worker.join(timeout=10)
    elapsed = time.monotonic() - started
    assert replies == [{"text": "slept 1s", "data": {"seconds": 1.0}, "is_error": False}]
    assert elapsed >= 1.0
    assert fake.call("slow_read", {"seconds": -1})["is_error"] is True


def test_model_call_can_be_slowed_for_budget_tests(fake: Fake) -> None:
    started = time.monotonic()
    reply = fake.call("generate_text_llm", {"prompt": "p", "delay_s": 0.5})
    assert reply["is_error"] is False
    assert time.monotonic() - started >= 0.5


def test_sigterm_stops_it_cleanly_and_it_logged_nothing(fake: Fake) -> None:
    fake.call("web_fetch", {"url": "https://jobs.example.org/42"})
    fake.call("nope", {})
    _http("GET", fake.url + "/nope")
    assert fake.stop() == 0
    assert fake.stderr_path.read_text() == ""
    with pytest.raises(OSError):
        _http("GET", fake.url + "/health", timeout=2.0)


def test_sigterm_does_not_wait_for_a_sleeping_request(fake: Fake) -> None:
    def slow() -> None:
        # The server goes away mid-request, as intended.
        with contextlib.suppress(OSError, AssertionError):
            fake.call("slow_read", {"seconds": 60})

    worker = threading.Thread(target=slow, daemon=True)
    worker.start()
    deadline = time.monotonic() + 5
    while not fake.state()["calls"]:
        assert time.monotonic() < deadline, "slow_read never arrived"
        threading.Event().wait(0.02)
    started = time.monotonic()
    assert fake.stop() == 0
    assert time.monotonic() - started < 5


# ----------------------------------------------------------------------- the workflow


def test_workflow_toml_and_seed(tmp_path: Path) -> None:
    workflow = load_workflow(EXAMPLE)
    assert workflow.name == "job-board"
    assert [(s.id, s.group) for s in workflow.steps] == [
        ("bid-pick-job", "bids"),
        ("bid-submit", "bids"),
        ("outreach", "outreach"),
    ]
    for step in workflow.steps:
        assert step.argv() == ["python3", f"/workflow/code/{step.id}.py"]
        assert step.prompt_file is not None
        assert (EXAMPLE / step.prompt_file).is_file()
        assert (EXAMPLE / "code" / f"{step.id}.py").is_file()
    assert workflow.bridge.upstream == "http://jobboard:8080"
    assert workflow.bridge.budgets == {"generate_text_llm": 20}

    shutil.copytree(EXAMPLE / "db", tmp_path / "db", ignore=shutil.ignore_patterns("db.sqlite*"))
    db_path = ensure_db(tmp_path)
    assert db_path is not None
    con = sqlite3.connect(db_path)
    try:
        assert con.execute("SELECT id, status FROM jobs ORDER BY id").fetchall() == [
            (41, "taken"),
            (42, "open"),
            (43, "open"),
        ]
        assert con.execute("SELECT id, job_id, status FROM proposals").fetchall() == [
            (7, 41, "submitted")
        ]
    finally:
        con.close()


class _StandInBridge:
    """What a test run's bridge does, from the real parts: policy, executor, upstream.

    Not the guard (no isolation, no action log, no identity binding beyond
    these fixed fields); it exists so the step scripts' logic can be checked
    on the host.
    """

    def __init__(self, group_dir: Path, upstream: str) -> None:
        self.executor = Executor(str(group_dir))
        self.upstream = upstream
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                data = json.dumps(outer.handle(body["tool"], body.get("arguments", {}))).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def handle(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        verdict = decide(tool, arguments, has_db_copy=True)
        reply = ToolReply(
            ok=verdict.decision is not Decision.REFUSE,
            tool=tool,
            session="s-1",
            decision=verdict.decision.value,
            reason=verdict.reason,
        )
        if verdict.decision is Decision.STUB:
            reply.result = ToolResult(text=stub_reply(tool, verdict.reason))
        elif verdict.route is Route.UPSTREAM:
            call = UpstreamCall.model_validate({"tool": tool, "arguments": arguments, **IDENTITY})
            status, result = _http(
                "POST",
                self.upstream + "/v1/tools/call",
                call.model_dump(),
                headers={RUN_KIND_HEADER: "test"},
            )
            assert status == 200
            reply.result = ToolResult.model_validate(result)
        elif verdict.route in (Route.DB, Route.LOCAL):
            reply.result = ToolResult.model_validate(self.executor.call(tool, arguments))
        reply.ok = reply.ok and not reply.result.is_error
        return reply.model_dump()

    def __enter__(self) -> _StandInBridge:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _prepare_group(tmp_path: Path, group: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    group_dir = tmp_path / "runs" / "test-1" / group
    shutil.copytree(REAL_RUN / group / "execution", group_dir)
    shutil.copytree(EXAMPLE / "db", tmp_path / "db", ignore=shutil.ignore_patterns("db.sqlite*"))
    db_path = ensure_db(tmp_path)
    assert db_path is not None
    monkeypatch.setenv("DB_PATH", str(db_path))  # the executor reads it at call time
    return group_dir


def _run_step(
    step: str, group_dir: Path, bridge_url: str | None
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "PYTHONDONTWRITEBYTECODE": "1",  # never write into the example's code/ folder
        "AGENTWORKS_TEST_MODE": "1",
    }
    if bridge_url is not None:
        env |= {"AGENTWORKS_BRIDGE_URL": bridge_url, "AGENTWORKS_BRIDGE_TOKEN": "t"}
    return subprocess.run(
        [sys.executable, str(EXAMPLE / "code" / f"{step}.py")],
        cwd=group_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("step", "group", "output", "upstream_tools"),
    [
        ("bid-pick-job", "bids", "claim.json", ["agent_browser", "agent_browser"]),
        ("bid-submit", "bids", "proposal.md", ["generate_text_llm"]),
        ("outreach", "outreach", "outreach.md", []),
    ],
)
def test_step_scripts_reach_only_reads_and_the_db_copy(
    fake: Fake,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    step: str,
    group: str,
    output: str,
    upstream_tools: list[str],
) -> None:
    group_dir = _prepare_group(tmp_path, group, monkeypatch)
    with _StandInBridge(group_dir, fake.url) as bridge:
        done = _run_step(step, group_dir, bridge.url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (group_dir / output).is_file()

    state = fake.state()
    assert [c["tool"] for c in state["calls"]] == upstream_tools
    assert all(c["run_kind_header"] == "test" for c in state["calls"])
    assert state["proposals"] == state["messages"] == state["clicks"] == []
    assert state["connects"] == 100

    con = sqlite3.connect(tmp_path / "db" / "db.sqlite")
    try:
        proposals = con.execute("SELECT id, job_id, status FROM proposals ORDER BY id").fetchall()
        job_42 = con.execute("SELECT status FROM jobs WHERE id = 42").fetchone()[0]
    finally:
        con.close()
    if step == "bid-pick-job":
        assert proposals == [(7, 41, "submitted"), (42, 42, "claimed")]
        assert job_42 == "claimed"
        assert json.loads((group_dir / output).read_text())["job_id"] == 42
    elif step == "bid-submit":
        assert proposals == [(7, 41, "submitted"), (42, 42, "submitted")]
        assert "TEST MODE: upwork_submit_proposal was NOT run" in done.stdout
        assert "stubbed (test mode)" in (group_dir / output).read_text()
    else:
        assert proposals == [(7, 41, "submitted")]
        assert done.stdout.count("send_slack_message: stub") == 2
        assert "notify_user: stub" in done.stdout


def test_step_script_without_a_bridge_fails_with_a_clear_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    group_dir = _prepare_group(tmp_path, "outreach", monkeypatch)
    done = _run_step("outreach", group_dir, None)
    assert done.returncode == 2
    assert "AGENTWORKS_BRIDGE_URL is not set" in done.stderr
