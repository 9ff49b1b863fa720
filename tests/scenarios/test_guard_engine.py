"""The guard against the real engine and a real upstream (the fake job-board API)."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker import DockerClient

from sandbox.contracts.layout import GUARD_UID
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.contracts.wire import ActionLine
from sandbox.policy import stub_reply
from sandbox.run.testrun import RunOptions, TestRun
from tests import paths
from tests.conftest import ThreadedRun, WorkflowFactory, call_lines, tree_digest

sys.path.insert(0, str(paths.REPO / "examples" / "job-board" / "fake_api"))
from harness import FakeJobBoard, fake_jobboard

pytestmark = pytest.mark.engine

JOBBOARD = paths.REPO / "examples" / "job-board"

CALLS_STEP = """
import json, sys, agentworks_bridge
calls = json.loads(sys.argv[1])
replies = []
for tool, args in calls:
    try:
        replies.append(agentworks_bridge.call(tool, args))
    except agentworks_bridge.BridgeError as exc:
        replies.append({"bridge_error": str(exc)})
print(json.dumps(replies))
"""


@pytest.fixture
def fake(engine: DockerClient) -> Iterator[FakeJobBoard]:
    with fake_jobboard(engine) as board:
        yield board
    assert not engine.networks.list(names=[board.network])


def run_calls(
    make_workflow: WorkflowFactory,
    fake: FakeJobBoard,
    calls: list[tuple[str, dict[str, Any]]],
    extra_toml: str = "",
    db_sql: str
    | None = "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT); INSERT INTO t VALUES (1, 'one');",
) -> tuple[TestRunRecord, list[dict[str, Any]], list[ActionLine]]:
    wf = make_workflow(
        command=["python3", "/workflow/code/step.py", json.dumps(calls)],
        extra_toml='[bridge]\nupstream = "http://jobboard:8080"\n' + extra_toml,
        db_sql=db_sql,
        earlier_files={"notes.txt": "earlier output\n"},
    )
    (wf / "code" / "step.py").write_text(textwrap.dedent(CALLS_STEP))
    before = tree_digest(wf)
    record = TestRun(wf, "step1", RunOptions(upstream_networks=(fake.network,))).execute()
    assert tree_digest(wf) == before
    run_root = wf / "runs" / record.id
    replies = json.loads(record.stdout.text.strip().splitlines()[-1]) if record.stdout.text else []
    return record, replies, call_lines(run_root / "test_mode_actions.jsonl")


EFFECT_ROWS: list[tuple[str, dict[str, Any], str]] = [
    ("generate_text_llm", {"prompt": "hi"}, "allow"),
    ("agent_browser", {"command": "open https://jobs.example.org/42"}, "allow"),
    ("web_fetch", {"url": "https://jobs.example.org/api/42"}, "allow"),
    ("query_workflow_db", {"sql": "SELECT v FROM t WHERE id = 1"}, "redirect"),
    ("mutate_workflow_db", {"sql": "INSERT INTO t VALUES (2, 'two')"}, "redirect"),
    ("mutate_workflow_db", {"sql": "CREATE TABLE m (x)"}, "stub"),
    ("backup_workflow_db", {}, "stub"),
    ("write_file", {"path": "out/hello.txt", "content": "hello"}, "allow"),
    ("read_file", {"path": "notes.txt"}, "allow"),
    ("execute_shell_command", {"command": "echo shell-ran; id -u"}, "allow"),
    ("call_sub_agent", {"task": "child"}, "allow"),
    ("agent_browser", {"command": "click #submit"}, "stub"),
    ("agent_browser", {"command": "eval document.forms[0].submit()"}, "stub"),
    ("notify_user", {"text": "hello"}, "stub"),
    ("send_slack_message", {"channel": "#sales", "text": "hi"}, "stub"),
    ("call_generic_agent", {"task": "x"}, "stub"),
    ("call_webhook", {"url": "https://hooks.example.org"}, "stub"),
    ("create_schedule", {"cron": "* * * * *"}, "stub"),
    ("update_knowledgebase", {"text": "x"}, "stub"),
    ("record_goal_observations", {"value": 1}, "stub"),
    ("upwork_submit_proposal", {"job_id": 42, "connects": 16}, "stub"),
    ("execute_step", {"step_id": "other"}, "refuse"),
    ("run_full_workflow", {}, "refuse"),
]


def test_every_row_of_the_effects_table(
    engine: DockerClient, make_workflow: WorkflowFactory, fake: FakeJobBoard
) -> None:
    calls = [(tool, args) for tool, args, _ in EFFECT_ROWS]
    record, replies, lines = run_calls(make_workflow, fake, calls)
    assert record.status is RunStatus.PASSED, record.stderr.text
    assert len(replies) == len(EFFECT_ROWS)
    assert len(lines) == len(EFFECT_ROWS)  # one log line per call, in order
    for (tool, args, expected), reply, line in zip(EFFECT_ROWS, replies, lines, strict=True):
        assert (reply["decision"], line.decision, line.tool) == (expected, expected, tool), args
        if expected == "stub":
            assert reply["ok"] is True
            assert reply["result"]["text"] == stub_reply(tool, reply["reason"])
        if expected == "refuse":
            assert reply["ok"] is False and "recursive" in reply["reason"]
    by_tool = {tool: reply for (tool, _, _), reply in zip(EFFECT_ROWS, replies, strict=True)}
    assert by_tool["query_workflow_db"]["result"]["data"]["rows"] == [["one"]]
    assert "shell-ran\n10001" in by_tool["execute_shell_command"]["result"]["text"]
    assert "earlier output" in by_tool["read_file"]["result"]["text"]
    assert by_tool["call_sub_agent"]["result"]["data"]["test_mode"] is True
    run_root = Path(record.workflow_dir) / "runs" / record.id
    assert (run_root / "g" / "out" / "hello.txt").read_text() == "hello"
    copy = sqlite3.connect(run_root / "db" / "db.sqlite")
    assert copy.execute("SELECT v FROM t WHERE id = 2").fetchone() == ("two",)

    # The upstream received exactly the allowed forwarded calls, marked as test calls.
    state = fake.state()
    assert [c["tool"] for c in state["calls"]] == [
        "generate_text_llm",
        "agent_browser",
        "web_fetch",
    ]
    assert {c["run_kind_header"] for c in state["calls"]} == {"test"}
    assert {c["run_id"] for c in state["calls"]} == {record.id}
    assert state["proposals"] == [] and state["messages"] == [] and state["clicks"] == []
    assert state["connects"] == 100

    # The record starts with the stubbed calls, one group per tool, counted exactly.
    stubbed = [t for t, _, d in EFFECT_ROWS if d == "stub"]
    tools = list(dict.fromkeys(stubbed))
    assert [(s.tool, s.count) for s in record.stubbed] == [(t, stubbed.count(t)) for t in tools]
    assert record.actions.stub == len(stubbed)
    assert record.summary_lines()[1] == (
        f"{len(stubbed)} call(s) were stubbed (would have run), {len(tools)} distinct tool(s):"
    )


def test_forged_identity_never_reaches_upstream(
    engine: DockerClient, make_workflow: WorkflowFactory, fake: FakeJobBoard
) -> None:
    """The envelope is the guard's; the tool's bound paths hold the guard's values; an
    argument the table does not bind (a top-level run_id here) is the step's own."""
    forged = {
        "prompt": "hi",
        "session": "forged",
        "metadata": {"run_id": "forged-run", "run_kind": "real"},
        "run_id": "the-steps-own-argument",
    }
    record, replies, lines = run_calls(make_workflow, fake, [("generate_text_llm", forged)])
    assert replies[0]["decision"] == "allow"
    (call,) = fake.state()["calls"]
    assert call["arguments"] == {
        "prompt": "hi",
        "session": "root",
        "metadata": {"run_id": record.id, "run_kind": "test"},
        "run_id": "the-steps-own-argument",
    }
    assert (call["run_id"], call["session"], call["workflow"], call["step"], call["run_kind"]) == (
        record.id,
        "root",
        "wf",
        "step1",
        "test",
    )
    assert "forged" not in json.dumps(call)
    assert lines[0].arguments == {"prompt": "hi", "run_id": "the-steps-own-argument"}
    assert lines[0].detail["overwrote"] == ["session", "metadata.run_id", "metadata.run_kind"]


def test_bad_requests_and_upstream_faults_fail_closed(
    engine: DockerClient, make_workflow: WorkflowFactory, fake: FakeJobBoard
) -> None:
    wf = make_workflow(
        command=["python3", "/workflow/code/step.py"],
        extra_toml=textwrap.dedent(
            """
            [bridge]
            upstream = "http://jobboard:8080"
            default_budget_s = 1
            grace_s = 0.5
            """
        ),
    )
    (wf / "code" / "step.py").write_text(
        textwrap.dedent(
            """
        import json, os, urllib.request, urllib.error, agentworks_bridge
        url = os.environ["AGENTWORKS_BRIDGE_URL"] + "/v1/tools/call"
        def post(body, token, to=url):
            req = urllib.request.Request(to, data=body, headers={"Authorization": "Bearer " + token})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status
            except urllib.error.HTTPError as exc:
                return exc.code
            except urllib.error.URLError as exc:  # the guard may answer 413 and close mid-upload
                # (a reset, or a broken pipe when the close came before the body was sent)
                cut = isinstance(exc.reason, (ConnectionResetError, BrokenPipeError))
                return "reset" if cut else str(exc)
        token = os.environ["AGENTWORKS_BRIDGE_TOKEN"]
        out = {
            "wrong_token": post(b'{"tool": "notify_user"}', "nope"),
            "malformed": post(b'{"tool": ', token),
            "extra_field": post(b'{"tool": "x", "evil": 1}', token),
            "huge": post(b'{"tool": "x", "arguments": {"a": "' + b"x" * (5 * 1024 * 1024) + b'"}}', token),
            "slow": agentworks_bridge.call("generate_text_llm", {"prompt": "x", "delay_s": 5}),
            "unknown": agentworks_bridge.call("brand_new_tool", {"x": 1}),
        }
        mcp = os.environ["AGENTWORKS_MCP_URL"]
        req = urllib.request.Request(mcp, headers={"Authorization": "Bearer " + token})
        with urllib.request.urlopen(req, timeout=10) as r:
            out["mcp_index"] = json.loads(r.read())
        out["mcp_unknown"] = post(b'{"jsonrpc": "2.0"}', token, mcp + "/jobs")
        print(json.dumps(out))
        """
        )
    )
    started = time.monotonic()
    record = TestRun(wf, "step1", RunOptions(upstream_networks=(fake.network,))).execute()
    assert record.status is RunStatus.PASSED, record.stderr.text
    out = json.loads(record.stdout.text)
    assert (out["wrong_token"], out["malformed"], out["extra_field"]) == (401, 400, 400)
    assert out["huge"] in (413, "reset")
    assert out["slow"]["ok"] is False and "time budget of 1.5 s" in out["slow"]["result"]["text"]
    assert out["unknown"]["decision"] == "stub"
    assert out["mcp_index"] == {"servers": []}  # this workflow configures no MCP server
    assert out["mcp_unknown"] == 404
    assert time.monotonic() - started < 30
    lines = call_lines(wf / "runs" / record.id / "test_mode_actions.jsonl")
    assert [ln.decision for ln in lines] == [
        "refuse",
        "refuse",
        "refuse",
        "refuse",
        "allow",
        "stub",
        "refuse",
    ]
    assert "no MCP server" in lines[6].reason
    assert "token" in lines[0].reason and "malformed" in lines[1].reason
    assert "larger than" in lines[3].reason
    assert lines[4].detail.get("timed_out") is True
    # The model call was abandoned at its budget; nothing else reached upstream.
    assert [c["tool"] for c in fake.state()["calls"]] == ["generate_text_llm"]


def test_upstream_down_is_a_clear_reply(
    engine: DockerClient, make_workflow: WorkflowFactory, fake: FakeJobBoard
) -> None:
    wf = make_workflow(
        command=[
            "python3",
            "/workflow/code/step.py",
            json.dumps([["generate_text_llm", {"prompt": "x"}]]),
        ],
        extra_toml='[bridge]\nupstream = "http://no-such-upstream:8080"\n',
    )
    (wf / "code" / "step.py").write_text(textwrap.dedent(CALLS_STEP))
    record = TestRun(wf, "step1", RunOptions(upstream_networks=(fake.network,))).execute()
    (reply,) = json.loads(record.stdout.text)
    assert reply["ok"] is False and "upstream bridge unreachable" in reply["result"]["text"]
    assert fake.state()["calls"] == []


def test_crew_call_is_refused_and_fails_the_step(
    engine: DockerClient, make_workflow: WorkflowFactory, fake: FakeJobBoard
) -> None:
    record, replies, _ = run_calls(make_workflow, fake, [("crew", {"project": "sales"})])
    assert replies[0]["decision"] == "refuse"
    assert record.status is RunStatus.FAILED
    assert "crew was refused in test mode" in record.reason


def test_killing_the_guard_stops_the_step_and_records_error(
    engine: DockerClient, make_workflow: WorkflowFactory, fake: FakeJobBoard
) -> None:
    """A step never runs on without its guard: the run kills it at once (it would sleep
    for 300 s) and records `error`, naming the guard; nothing reached upstream."""
    wf = make_workflow(command=["python3", "/workflow/code/step.py"], timeout_s=600)
    (wf / "code" / "step.py").write_text(
        textwrap.dedent(
            """
        import pathlib, time, agentworks_bridge
        assert agentworks_bridge.call("notify_user", {"text": "one"})["decision"] == "stub"
        pathlib.Path("ready").write_text("1")
        time.sleep(300)
        print("the step outlived its guard")
        """
        )
    )
    with ThreadedRun(wf, RunOptions(upstream_networks=(fake.network,)), join_s=120) as run:
        run.wait_for_in_group("ready")
        run.guard(engine, run.layout.run_id).kill()
    assert run.finished, "the run went on without its guard"
    record = run.record
    assert record.status is RunStatus.ERROR and "guard stopped" in record.reason
    assert record.exit_code == 137  # killed, not finished
    assert "outlived" not in record.stdout.text
    assert fake.state()["calls"] == []


def test_job_board_steps_pass_and_change_nothing_outside(
    engine: DockerClient, fake: FakeJobBoard, tmp_path: Path
) -> None:
    import shutil

    wf = tmp_path / "job-board"
    shutil.copytree(
        JOBBOARD, wf, ignore=shutil.ignore_patterns("test-*", "db.sqlite*", "__pycache__")
    )
    sys.path.insert(0, str(JOBBOARD.parent))
    from setup import ensure_db

    ensure_db(wf)
    before = tree_digest(wf)
    records = {
        step: TestRun(wf, step, RunOptions(upstream_networks=(fake.network,))).execute()
        for step in ("bid-pick-job", "bid-submit", "outreach")
    }
    for step, record in records.items():
        assert record.status is RunStatus.PASSED, (step, record.stdout.text, record.stderr.text)
    assert tree_digest(wf) == before
    state = fake.state()
    assert state["proposals"] == [] and state["messages"] == [] and state["clicks"] == []
    assert state["connects"] == 100

    pick = records["bid-pick-job"]
    copy = sqlite3.connect(wf / "runs" / pick.id / "db" / "db.sqlite")
    assert copy.execute("SELECT status FROM proposals WHERE id = 42").fetchone() == ("claimed",)
    assert pick.db_diff is not None
    tables = {t.name: t for t in pick.db_diff.tables}
    assert tables["proposals"].inserted == 1 and tables["jobs"].updated == 1
    assert any("proposals: 1 inserted (id=42)" in line for line in pick.summary_lines())

    assert {s.tool for s in records["bid-submit"].stubbed} >= {
        "upwork_submit_proposal",
        "agent_browser",
    }
    assert {s.tool for s in records["outreach"].stubbed} >= {"send_slack_message", "notify_user"}
    real = sqlite3.connect(f"file:{wf / 'db' / 'db.sqlite'}?mode=ro", uri=True)
    assert real.execute("SELECT count(*) FROM proposals WHERE status = 'claimed'").fetchone() == (
        0,
    )


def _status_fields(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def test_the_running_guard_holds_no_capability_and_left_no_config(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    """NET_ADMIN is the entry script's only: every process of a live guard runs as the
    guard uid with all capability sets empty, and the config file (tokens) is gone."""
    wf = make_workflow(command=["python3", "/workflow/code/step.py"])
    (wf / "code" / "step.py").write_text(
        textwrap.dedent(
            """
        import pathlib, time, agentworks_bridge
        assert agentworks_bridge.call("notify_user", {"text": "up"})["decision"] == "stub"
        pathlib.Path("ready").write_text("1")
        deadline = time.monotonic() + 60
        while not pathlib.Path("go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        """
        )
    )
    ready: Path | None = None
    with ThreadedRun(wf, join_s=120) as run:
        try:
            ready = run.wait_for_in_group("ready")
            run_root = run.layout.root
            guard = run.guard(engine, run_root.name)
            top = guard.top()
            pid_column = top["Titles"].index("PID")
            pids = [int(row[pid_column]) for row in top["Processes"]]
            statuses = [_status_fields(pid) for pid in pids]
            # Only the guard's own processes: tini and the guard (no MCP server runs here).
            assert sorted(s["Name"] for s in statuses) == ["python", "tini"], statuses
            for status in statuses:
                assert status["Uid"].split() == [str(GUARD_UID)] * 4, status["Name"]
                for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                    assert int(status[field], 16) == 0, (status["Name"], field)
                assert status["NoNewPrivs"].strip() == "1"
            # The guard is non-dumpable: its /proc files are root's, so not even a
            # process of its own uid could read its memory or environment.
            (guard_pid,) = [p for p, s in zip(pids, statuses, strict=True) if s["Name"] == "python"]
            assert os.stat(f"/proc/{guard_pid}/mem").st_uid == 0
            code, output = guard.exec_run(
                ["sh", "-c", "cat /proc/$(pgrep -o -x python)/environ"], user=f"{GUARD_UID}"
            )
            assert code != 0 and b"Permission denied" in output, output
            assert not (run_root / "guard" / "config.json").exists()
            assert sorted(p.name for p in (run_root / "guard").iterdir()) == []
        finally:
            if ready is not None:  # the step waits for `go`
                (ready.parent / "go").write_text("1")
    assert run.record.status is RunStatus.PASSED, run.record.reason
