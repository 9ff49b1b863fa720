"""Recorded reads and replay against the real engine, the outside world as real servers
(the fake job-board API, the fake outside server) that are stopped for a replay."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker import DockerClient

import sandbox
from sandbox.contracts.layout import RunLayout
from sandbox.contracts.record import TestRunRecord
from sandbox.contracts.recording import BLOBS_DIR, RECORDING_DIR, RecordingSettings
from sandbox.run.testrun import RunOptions, TestRun
from sandbox.verify.diff import RunComparison
from sandbox.verify.gate import gate
from sandbox.verify.verifystep import verify_step
from tests import paths
from tests.conftest import WorkflowFactory, call_lines
from tests.fakes.harness import ALIAS, Outside, outside_server

REPO = paths.REPO
JOBBOARD = REPO / "examples" / "job-board"
sys.path.insert(0, str(JOBBOARD / "fake_api"))
sys.path.insert(0, str(REPO / "examples"))
from harness import fake_jobboard  # noqa: E402
from setup import ensure_db  # noqa: E402

pytestmark = pytest.mark.engine

MIB = 1024 * 1024
EGRESS = f"""
[egress]
allow = [{{ host = "{ALIAS}", port = 8080 }}]
"""
READS = """
import json, urllib.request, urllib.error
out = {}
def fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
for path in PATHS:
    out[path] = fetch("http://outside.test:8080" + path)
print(json.dumps(out))
"""


@pytest.fixture
def outside(engine: DockerClient) -> Iterator[Outside]:
    with outside_server(engine) as server:
        yield server


def reads_step(make_workflow: WorkflowFactory) -> Path:
    return make_workflow(
        command=["python3", "/workflow/code/step.py"], extra_toml=EGRESS, db_sql=None
    )


def set_paths(wf: Path, *paths: str) -> None:
    (wf / "code" / "step.py").write_text(f"PATHS = {list(paths)!r}\n" + textwrap.dedent(READS))


def answers(record: TestRunRecord) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(record.stdout.text.strip().splitlines()[-1])
    return out


def root_of(wf: Path, record: TestRunRecord, group: str = "g") -> Path:
    return RunLayout(wf, record.id, group).root


def test_replay_with_the_fake_api_stopped_gives_the_live_ledger_and_the_gate_refuses_it(
    engine: DockerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bid-submit's model call is recorded live; with the fake job-board API gone, the
    replay answers it from the recording: the same ledger, the same proposal, a
    verification that passes and says it was replayed, which the gate refuses unless
    the host's config accepts replayed verifications."""
    wf = tmp_path / "job-board"
    shutil.copytree(
        JOBBOARD, wf, ignore=shutil.ignore_patterns("test-*", "db.sqlite*", "__pycache__")
    )
    ensure_db(wf)
    with fake_jobboard(engine) as fake:
        live = TestRun(wf, "bid-submit", RunOptions(upstream_networks=(fake.network,))).execute()
    assert live.status.value == "passed", live.reason
    assert live.recording is not None and live.recording.kept >= 1
    assert live.replay is None
    live_root = root_of(wf, live, "bids")

    # the fake API and its network are gone: nothing answers upstream any more
    verification = verify_step(wf, "bid-submit", RunOptions(replay=live.id))
    assert verification.passed, "\n".join(verification.lines())
    assert verification.replay is not None and verification.replay.run_id == live.id
    assert verification.replay.misses == 0 and verification.replay.hits >= 1
    assert any(line.startswith("REPLAYED: ") for line in verification.lines())
    replayed_root = wf / "runs" / verification.run_id
    comparison = sandbox.compare(live_root, replayed_root)
    assert isinstance(comparison, RunComparison)
    assert comparison.calls == [] and comparison.db == [] and comparison.files == []
    lines = call_lines(replayed_root / "test_mode_actions.jsonl")
    llm = [ln for ln in lines if ln.tool == "generate_text_llm"]
    assert [ln.detail.get("replay") for ln in llm] == ["hit"]

    from sandbox.cli import main

    html = tmp_path / "report.html"
    assert main(["report", str(replayed_root), "--html", str(html)]) == 0
    page = html.read_text()
    assert '<section id="replay"><h2>Replayed, not live</h2>' in page and live.id in page
    assert main(["report", str(live_root), "--html", str(html)]) == 0
    assert "Replayed, not live" not in html.read_text()

    refused = gate(wf, "bid-submit")
    assert not refused.ok and "replayed from the recording of " + live.id in refused.reason
    host = tmp_path / "host.toml"
    host.write_text("accept_replayed_verifications = true\n")
    monkeypatch.setenv("SANDBOX_HOST_CONFIG", str(host))
    assert gate(wf, "bid-submit").ok


def test_a_replay_of_a_step_changed_to_read_a_new_url_records_one_miss_and_stubs_it(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = reads_step(make_workflow)
    set_paths(wf, "/page", "/other")
    with outside_server(engine) as outside:
        live = TestRun(wf, "step1", RunOptions(upstream_networks=(outside.network,))).execute()
    assert live.status.value == "passed", live.reason
    assert answers(live)["/page"] == [200, "hello from outside /page"]

    set_paths(wf, "/page", "/other", "/new")
    replayed = TestRun(wf, "step1", RunOptions(replay=live.id)).execute()
    assert replayed.status.value == "passed", replayed.reason
    out = answers(replayed)
    assert out["/page"] == [200, "hello from outside /page"]
    assert out["/other"] == [200, "hello from outside /other"]
    assert out["/new"][0] == 503 and out["/new"][1].startswith("TEST MODE: replay miss: ")
    assert replayed.replay is not None and replayed.replay.run_id == live.id
    assert replayed.replay.hits == 2 and replayed.replay.misses == 1
    (miss,) = replayed.replay.misses_named
    assert miss.what == f"GET http://{ALIAS}:8080/new" and not miss.went_live
    egress = call_lines(root_of(wf, replayed) / "test_mode_actions.jsonl")
    misses = [ln for ln in egress if ln.detail.get("replay") == "miss"]
    assert len(misses) == 1 and misses[0].arguments["url"].endswith("/new")
    assert replayed.actions.stub == 0  # a miss is a read not made, not an effect


def test_replay_miss_live_sends_only_the_miss(
    engine: DockerClient, outside: Outside, make_workflow: WorkflowFactory
) -> None:
    wf = reads_step(make_workflow)
    set_paths(wf, "/page")
    network = RunOptions(upstream_networks=(outside.network,))
    live = TestRun(wf, "step1", network).execute()
    assert live.status.value == "passed", live.reason
    seen_live = len(outside.seen())

    set_paths(wf, "/page", "/fresh")
    options = RunOptions(upstream_networks=(outside.network,), replay=live.id, replay_miss="live")
    replayed = TestRun(wf, "step1", options).execute()
    out = answers(replayed)
    assert out == {
        "/page": [200, "hello from outside /page"],
        "/fresh": [200, "hello from outside /fresh"],
    }
    assert [s["path"] for s in outside.seen()[seen_live:]] == ["/fresh"]
    assert replayed.replay is not None and replayed.replay.misses == 1
    assert replayed.replay.misses_named[0].went_live


def test_a_100_mib_read_is_relayed_whole_and_the_recording_stays_within_its_cap(
    engine: DockerClient, outside: Outside, make_workflow: WorkflowFactory
) -> None:
    size = 100 * MIB
    wf = make_workflow(
        command=["python3", "/workflow/code/step.py"], extra_toml=EGRESS, db_sql=None
    )
    (wf / "code" / "step.py").write_text(
        textwrap.dedent(
            f"""
            import hashlib, urllib.request
            with urllib.request.urlopen("http://outside.test:8080/bytes/{size}", timeout=60) as r:
                n = 0
                while chunk := r.read(1 << 20):
                    n += len(chunk)
            with urllib.request.urlopen("http://outside.test:8080/small", timeout=30) as r:
                r.read()
            print(n)
            """
        )
    )
    cap = RecordingSettings(cap_bytes=8 * MIB, body_cap_bytes=4 * MIB)
    options = RunOptions(upstream_networks=(outside.network,), recording=cap)
    record = TestRun(wf, "step1", options).execute()
    assert record.status.value == "passed", record.reason
    assert record.stdout.text.strip() == str(size)
    summary = record.recording
    assert summary is not None and summary.cap_bytes == 8 * MIB
    assert summary.kept == 1 and summary.not_kept == 1
    (big,) = summary.not_kept_named
    assert big.what.endswith(f"/bytes/{size}") and big.bytes > size
    assert "per-answer cap" in big.why
    blobs = root_of(wf, record) / "guard" / RECORDING_DIR / BLOBS_DIR
    assert sum(p.stat().st_size for p in blobs.iterdir()) <= 8 * MIB


def test_the_job_board_fix_demo_names_the_connects_argument_and_replays_with_the_api_stopped(
    engine: DockerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sys.path.insert(0, str(JOBBOARD))
    import demo_fix

    assert demo_fix.main(str(tmp_path)) == 0
    out = capsys.readouterr().out.splitlines()
    diff = out[out.index("1 difference(s):") + 1]
    assert diff.endswith("upwork_submit_proposal at A #3 / B #3: connects 15 -> 16")
    replayed = next(i for i, line in enumerate(out) if line.startswith("verdict: PASS"))
    assert out[replayed + 1].startswith("REPLAYED: reads answered from the recording of test-")
    assert ": 1 hit(s), 0 miss(es)" in out[replayed + 1]


DIRECT = """
import json, os, urllib.request
for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
    os.environ.pop(var, None)
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
with opener.open("http://outside.test:8080/direct", timeout=20) as r:
    print(json.dumps([r.status, r.read().decode()]))
"""


def test_a_direct_connection_is_recorded_and_replayed_without_reaching_the_host(
    engine: DockerClient, outside: Outside, make_workflow: WorkflowFactory
) -> None:
    """The firewall's redirected connections go through the same recording: the replay
    answers the step and the host never sees the request again."""
    wf = reads_step(make_workflow)
    (wf / "code" / "step.py").write_text(textwrap.dedent(DIRECT))
    network = RunOptions(upstream_networks=(outside.network,))
    live = TestRun(wf, "step1", network).execute()
    assert live.stdout.text.strip() == json.dumps([200, "hello from outside /direct"])
    replay = RunOptions(upstream_networks=(outside.network,), replay=live.id)
    replayed = TestRun(wf, "step1", replay).execute()
    assert replayed.stdout.text == live.stdout.text
    assert [s["path"] for s in outside.seen() if s.get("path") == "/direct"] == ["/direct"]
    lines = call_lines(root_of(wf, replayed) / "test_mode_actions.jsonl")
    (line,) = [ln for ln in lines if ln.tool == "http"]
    assert line.detail["via"] == "direct" and line.detail["replay"] == "hit"
    assert replayed.replay is not None and replayed.replay.hits == 1


MCP_TIME = """
[[mcp_servers]]
name = "time"
command = ["mcp-server-time", "--local-timezone", "UTC"]
"""
MCP_STEP = """
import json
import agentworks_mcp as mcp
with mcp.connect("time") as s:
    out = {zone: s.call_tool("get_current_time", {"timezone": zone}) for zone in ZONES}
print(json.dumps(out))
"""


def test_mcp_read_results_are_replayed_from_the_cli_and_a_new_call_is_a_miss(
    engine: DockerClient, make_workflow: WorkflowFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """The time server's answer changes by the second: the replay gives the recorded one;
    a call with other arguments is not in the recording and gets the miss."""
    from sandbox.cli import main

    wf = make_workflow(
        command=["python3", "/workflow/code/step.py"], extra_toml=MCP_TIME, db_sql=None
    )
    step = wf / "code" / "step.py"
    step.write_text('ZONES = ["UTC"]\n' + textwrap.dedent(MCP_STEP))
    live = TestRun(wf, "step1", RunOptions()).execute()
    assert live.status.value == "passed", live.reason
    recorded = answers(live)["UTC"]
    assert recorded["isError"] is False

    step.write_text('ZONES = ["UTC", "Asia/Tokyo"]\n' + textwrap.dedent(MCP_STEP))
    capsys.readouterr()
    assert main(["run", str(wf), "step1", "--replay", live.id, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    replayed = TestRunRecord.model_validate(printed)
    out = answers(replayed)
    assert out["UTC"] == recorded
    assert out["Asia/Tokyo"]["isError"] is True
    assert out["Asia/Tokyo"]["content"][0]["text"].startswith("TEST MODE: replay miss: mcp time/")
    assert replayed.replay is not None and (replayed.replay.hits, replayed.replay.misses) == (1, 1)
    lines = call_lines(root_of(wf, replayed) / "test_mode_actions.jsonl")
    calls = [ln for ln in lines if ln.tool == "mcp:time/get_current_time"]
    assert [ln.detail.get("replay") for ln in calls] == ["hit", "miss"]


MODEL = f"""
[egress]
allow = [{{ host = "{ALIAS}", port = 8080, model = true }}]
"""
PROMPTS = """
import json, urllib.request
out = []
for prompt in PROMPTS:
    req = urllib.request.Request("http://outside.test:8080/v1/complete", data=prompt.encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            out.append([r.status, r.read().decode()])
    except urllib.error.HTTPError as exc:
        out.append([exc.code, exc.read().decode()])
print(json.dumps(out))
"""


def test_a_model_call_is_matched_by_its_body(
    engine: DockerClient, outside: Outside, make_workflow: WorkflowFactory
) -> None:
    """A model entry's POST is a read with a body: the same body is answered from the
    recording, another body is a miss (and nothing reaches the host in the replay)."""
    wf = make_workflow(command=["python3", "/workflow/code/step.py"], extra_toml=MODEL, db_sql=None)
    step = wf / "code" / "step.py"
    step.write_text('PROMPTS = ["prompt A"]\n' + textwrap.dedent(PROMPTS))
    network = RunOptions(upstream_networks=(outside.network,))
    live = TestRun(wf, "step1", network).execute()
    assert json.loads(live.stdout.text) == [[200, "done"]]
    before = len(outside.seen())

    step.write_text('PROMPTS = ["prompt A", "prompt B"]\n' + textwrap.dedent(PROMPTS))
    replay = RunOptions(upstream_networks=(outside.network,), replay=live.id)
    replayed = TestRun(wf, "step1", replay).execute()
    (hit, miss) = json.loads(replayed.stdout.text)
    assert hit == [200, "done"]
    assert miss[0] == 503 and miss[1].startswith("TEST MODE: replay miss: POST http://")
    assert len(outside.seen()) == before
    assert replayed.replay is not None and (replayed.replay.hits, replayed.replay.misses) == (1, 1)
