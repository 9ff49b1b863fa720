"""Verifications against real test runs on the real engine: every kind of expectation
holding and failing, with the explanation a reader gets asserted."""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
import xmlschema
from docker import DockerClient

from sandbox.cli import main
from sandbox.contracts.config import load_workflow
from sandbox.contracts.exitcodes import ExitCode
from sandbox.contracts.layout import RunLayout
from sandbox.contracts.record import read_record, write_record
from sandbox.run.testrun import RunOptions, TestRun
from sandbox.verify.check import ExpectationResult
from sandbox.verify.expect import load_expectations
from sandbox.verify.finished import FinishedStep
from sandbox.verify.verification import Verification
from sandbox.verify.verifystep import judge, with_implicit_status
from tests import paths
from tests.conftest import write_workflow
from tests.fakes.harness import outside_server

pytestmark = pytest.mark.engine

JUNIT_XSD = paths.TESTS / "data" / "junit.xsd"

STEP = """
import json, pathlib, urllib.error, urllib.request
import agentworks_bridge as bridge

def call(tool, args):
    reply = bridge.call(tool, args)
    assert reply["ok"], reply
    return reply

call("send_slack_message", {"channel": "@dana", "text": "Hi Dana, a question"})
call("upwork_submit_proposal", {"job_id": 42, "connects": 16, "text": "Dear client",
                                "meta": {"tier": "pro", "tags": ["flask"]}})
call("send_slack_message", {"channel": "@omar", "text": "Hi Omar, a question"})
call("mutate_workflow_db", {"sql": "INSERT INTO t (id, v) VALUES (2, 'two')"})
call("mutate_workflow_db", {"sql": "UPDATE t SET v = 'uno' WHERE id = 1"})
pathlib.Path("out.json").write_text(json.dumps({"job_id": 42, "status": "submitted"}))
pathlib.Path("notes.md").write_text("submitted job 42 for 16 Connects\\n")
pathlib.Path("old.txt").unlink()
request = urllib.request.Request("http://outside.test:8080/effect", data=b"x", method="POST")
try:
    urllib.request.urlopen(request, timeout=20)
except urllib.error.HTTPError as exc:  # the stub's answer
    print(exc.code)
"""

EGRESS = """
[egress]
allow = [{ host = "outside.test", port = 8080 }]
"""


@pytest.fixture(scope="module")
def one_run(
    engine: DockerClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, Path]]:
    """One real run whose step does a bit of everything; the tests judge it many ways."""
    root = tmp_path_factory.mktemp("verify")
    wf = write_workflow(
        root,
        command=["python3", "/workflow/code/step.py"],
        earlier_files={"old.txt": "gone soon", "keep.txt": "stays"},
        extra_toml=EGRESS,
    )
    (wf / "code" / "step.py").write_text(textwrap.dedent(STEP))
    with outside_server(engine) as outside:
        record = TestRun(wf, "step1", RunOptions(upstream_networks=(outside.network,))).execute()
        assert outside.seen() == [], "a stubbed POST reached the outside"
    assert record.status.value == "passed", record.stderr.text
    yield wf, RunLayout(wf, record.id, "g").root


def judge_toml(wf: Path, run_root: Path, toml: str) -> list[ExpectationResult]:
    """The run judged by expectations written as an expectation file."""
    (wf / "expect.toml").write_text(textwrap.dedent(toml))
    workflow = load_workflow(wf)
    step = workflow.step("step1").model_copy(update={"expect_file": "expect.toml"})
    return judge(FinishedStep.load(run_root), load_expectations(wf, workflow, step)).results


def one(wf: Path, run_root: Path, toml: str) -> ExpectationResult:
    (result,) = judge_toml(wf, run_root, "[[expect]]\n" + textwrap.dedent(toml))
    return result


def test_call_expectations_hold_and_fail_with_the_deciding_line(
    one_run: tuple[Path, Path],
) -> None:
    wf, run = one_run
    ok = one(
        wf,
        run,
        """
        kind = "call"
        tool = "upwork_submit_proposal"
        args = [{ path = "$.job_id", equals = 42 }, { path = "$.connects", equals = 16 },
                { path = "$.meta", subset = { tier = "pro" } }, { path = "$.text", regex = "^Dear" }]
        count = 1
        """,
    )
    assert ok.ok, ok
    assert ok.happened == "1 matching call(s)"
    assert ok.evidence[0].startswith("action log line 2: {")
    assert '"upwork_submit_proposal"' in ok.evidence[0]

    wrong = one(
        wf,
        run,
        """
        kind = "call"
        tool = "upwork_submit_proposal"
        args = [{ path = "$.connects", equals = 20 }]
        count = 1
        """,
    )
    assert not wrong.ok
    assert wrong.line() == (
        "FAIL upwork_submit_proposal with $.connects == 20 would have run exactly 1 time(s): "
        "0 matching call(s); nearest: line 2 has $.connects = 16"
    )

    too_many = one(wf, run, 'kind = "call"\ntool = "send_slack_message"\nat_most = 1\n')
    assert not too_many.ok and too_many.happened == "2 matching call(s)"
    assert [e.split(":")[0] for e in too_many.evidence] == [
        "action log line 1",
        "action log line 3",
    ]

    # Allowed (redirected) calls count only when the expectation says so.
    redirected = one(wf, run, 'kind = "call"\ntool = "mutate_workflow_db"\n')
    assert not redirected.ok
    assert redirected.happened.startswith("0 matching call(s) (and 2 with another decision:")
    assert one(
        wf, run, 'kind = "call"\ntool = "mutate_workflow_db"\ndecision = "any"\ncount = 2\n'
    ).ok


def test_egress_and_order_expectations(one_run: tuple[Path, Path]) -> None:
    wf, run = one_run
    post = one(wf, run, 'kind = "call"\nmethod = "POST"\nhost = "outside.test"\ncount = 1\n')
    assert post.ok, post
    assert '"http"' in post.evidence[0] and "outside.test" in post.evidence[0]
    results = judge_toml(
        wf,
        run,
        """
        [[expect]]
        name = "submit"
        kind = "call"
        tool = "upwork_submit_proposal"

        [[expect]]
        name = "omar after submit"
        kind = "call"
        tool = "send_slack_message"
        args = [{ path = "$.channel", equals = "@omar" }]
        after = "submit"

        [[expect]]
        name = "dana after submit"
        kind = "call"
        tool = "send_slack_message"
        args = [{ path = "$.channel", equals = "@dana" }]
        after = "submit"
        """,
    )
    by = {r.label: r for r in results}
    assert by["omar after submit"].ok
    assert not by["dana after submit"].ok
    assert by["dana after submit"].happened == (
        "1 matching call(s); line 1 comes before 'submit' (line 2)"
    )


def test_no_call_expectations(one_run: tuple[Path, Path]) -> None:
    wf, run = one_run
    assert one(wf, run, 'kind = "no_call"\ntool = "notify_user"\n').ok
    assert one(wf, run, 'kind = "no_call"\nmethod = "DELETE"\nhost = "outside.test"\n').ok
    tried = one(
        wf,
        run,
        'kind = "no_call"\ntool = "send_slack_message"\n'
        'args = [{ path = "$.channel", equals = "@omar" }]\n',
    )
    assert not tried.ok
    assert tried.happened == "tried 1 time(s) (decision stub)"
    assert tried.evidence[0].startswith("action log line 3:")


def test_db_expectations(one_run: tuple[Path, Path]) -> None:
    wf, run = one_run
    results = judge_toml(
        wf,
        run,
        """
        [[expect]]
        kind = "db"
        table = "t"
        change = "inserted"
        where = { id = 2, v = "two" }
        count = 1

        [[expect]]
        kind = "db"
        table = "t"
        change = "updated"
        where = { id = 1, v = { regex = "^un" } }

        [[expect]]
        kind = "no_other_db_changes"
        """,
    )
    assert all(r.ok for r in results), results
    assert results[0].evidence == ['db t inserted row: id=2, v="two"']
    assert results[2].happened == "every one of 2 changed row(s) is expected"

    results = judge_toml(
        wf,
        run,
        """
        [[expect]]
        kind = "db"
        table = "t"
        change = "deleted"

        [[expect]]
        kind = "db"
        table = "t"
        change = "inserted"
        where = { id = 2 }

        [[expect]]
        kind = "no_other_db_changes"
        """,
    )
    deleted, _inserted, others = results
    assert not deleted.ok
    assert deleted.happened == "0 matching row(s); t: 1 inserted, 1 updated, 0 deleted"
    assert not others.ok
    assert others.happened == "an unexpected change in t"
    assert others.evidence == ['db t updated row: id=1, v="uno"']


def test_file_expectations(one_run: tuple[Path, Path]) -> None:
    wf, run = one_run
    results = judge_toml(
        wf,
        run,
        """
        [[expect]]
        kind = "file"
        path = "out.json"
        change = "created"
        content = [{ path = "$.job_id", equals = 42 }, { subset = { status = "submitted" } }]

        [[expect]]
        kind = "file"
        path = "notes.md"
        content = [{ contains = "16 Connects" }, { regex = "job [0-9]+" }]

        [[expect]]
        kind = "file"
        path = "old.txt"
        change = "deleted"

        [[expect]]
        kind = "file"
        path = "keep.txt"
        change = "untouched"
        """,
    )
    assert all(r.ok for r in results), results
    results = judge_toml(
        wf,
        run,
        """
        [[expect]]
        kind = "file"
        path = "out.json"
        content = [{ path = "$.job_id", equals = 43 }]

        [[expect]]
        kind = "file"
        path = "notes.md"
        content = [{ path = "$.x", exists = true }]

        [[expect]]
        kind = "file"
        path = "keep.txt"
        change = "changed"
        """,
    )
    wrong_id, not_json, untouched = results
    assert wrong_id.happened == "out.json created; content fails $.job_id == 43 (found 42)"
    assert not_json.happened == "notes.md created; its content is not JSON"
    assert untouched.happened == "keep.txt untouched"
    assert untouched.evidence == ["record files: keep.txt untouched"]
    assert not any(r.ok for r in results)


def test_status_expectations(one_run: tuple[Path, Path]) -> None:
    wf, run = one_run
    assert one(wf, run, 'kind = "status"\nexit_code = 0\n').ok
    failed = one(wf, run, 'kind = "status"\nstatus = "failed"\n')
    assert not failed.ok and failed.happened == "status passed, exit code 0"


def test_verify_cli_json_and_junit(
    engine: DockerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`sandbox verify`: exit 0 only when every expectation holds; --json and a JUnit
    file valid against the JUnit schema, one testcase per expectation."""
    wf = write_workflow(
        tmp_path,
        command=["python3", "/workflow/code/step.py"],
        extra_toml=textwrap.dedent(
            """
            [[steps.expect]]
            kind = "call"
            tool = "notify_user"
            count = 1

            [[steps.expect]]
            kind = "no_call"
            tool = "send_email"
            """
        ),
    )
    (wf / "code" / "step.py").write_text(
        "import agentworks_bridge as b\nb.call('notify_user', {'text': 'done'})\n"
    )
    junit = tmp_path / "verdict.xml"
    page = tmp_path / "report.html"
    assert main(["verify", str(wf), "step1", "--junit", str(junit), "--html", str(page)]) == 0
    assert "PASS: 3 of 3 expectation(s) held" in page.read_text()
    out = capsys.readouterr().out
    assert out.startswith("verdict: PASS: step step1, 3 of 3 expectation(s) held")
    assert "  PASS notify_user would have run exactly 1 time(s)" in out
    assert "stubbed (would have run): notify_user x1" in out
    schema = xmlschema.XMLSchema(JUNIT_XSD)
    schema.validate(junit)
    cases = ET.parse(junit).getroot().findall("testsuite/testcase")
    assert len(cases) == 3 and not any(c.find("failure") is not None for c in cases)

    (wf / "code" / "step.py").write_text("print('forgot to notify')\n")
    assert main(["verify", str(wf), "step1", "--json", "--junit", str(junit)]) == 1
    verification = Verification.model_validate_json(capsys.readouterr().out)
    assert not verification.passed
    assert verification.results[0].happened == "0 matching call(s)"
    schema.validate(junit)
    failures = ET.parse(junit).getroot().findall("testsuite/testcase/failure")
    assert len(failures) == 1
    assert failures[0].get("message", "").endswith("; 0 matching call(s)")
    # The verdict stays beside the run's record.
    saved = FinishedStep.load(RunLayout(wf, verification.run_id, "g").root).verification
    assert saved is not None and saved.results == verification.results
    listed = main(["list", str(wf)])
    assert listed == 0
    text = capsys.readouterr().out
    assert "verifications (oldest first):" in text
    assert "step1  pass" in text and "step1  FAIL: notify_user would have run" in text


def test_a_run_that_errored_never_verifies(engine: DockerClient, tmp_path: Path) -> None:
    """Without a status expectation the run must have passed: a step that failed
    before its calls proves nothing, even when every expectation is a `no_call`."""
    from sandbox.verify.verifystep import verify_step

    wf = write_workflow(
        tmp_path,
        command="exit 3",
        extra_toml='[[steps.expect]]\nkind = "no_call"\ntool = "send_email"\n',
    )
    verification = verify_step(wf, "step1")
    assert not verification.passed
    assert [r.ok for r in verification.results] == [True, False]
    assert verification.results[1].happened == (
        "status failed, exit code 3 (step exited with code 3)"
    )
    assert json.loads(verification.model_dump_json())["passed"] is False


MCP_STEP = """
import agentworks_mcp as mcp
with mcp.connect("time") as s:
    s.call_tool("get_current_time", {"timezone": "UTC"})
with mcp.connect("memory") as s:
    s.call_tool("read_graph", {})
    s.call_tool("create_entities", {"entities": [{"name": "Acme", "entityType": "client",
                                                   "observations": ["posted job 42"]}]})
"""

MCP_SERVERS = """
[[mcp_servers]]
name = "memory"
command = ["mcp-server-memory"]
env = { MEMORY_FILE_PATH = "/workflow/memory/graph.jsonl" }

[[mcp_servers]]
name = "time"
command = ["mcp-server-time", "--local-timezone", "UTC"]
"""

MCP_EXPECT = """
[[steps.expect]]
name = "remembers the client"
kind = "call"
tool = "mcp:memory/create_entities"
args = [{ path = "$.entities[0]", subset = { name = "Acme", entityType = "client" } }]
count = 1

[[steps.expect]]
kind = "call"
tool = "mcp:time/get_current_time"
decision = "allow"
count = 1

[[steps.expect]]
kind = "no_call"
tool = "mcp:memory/delete_entities"

[[steps.expect]]
kind = "call"
tool = "mcp:memory/create_relations"
"""


def test_mcp_tool_expectations(engine: DockerClient, tmp_path: Path) -> None:
    """`mcp:<server>/<tool>` names a tool of a connected server, stubbed or passed."""
    from sandbox.verify.verifystep import verify_step

    wf = tmp_path / "wf"
    (wf / "code").mkdir(parents=True)
    (wf / "memory").mkdir()
    (wf / "memory" / "graph.jsonl").write_text("")
    head = 'name = "wf"\n[[steps]]\nid = "step1"\ngroup = "g"\n'
    head += 'command = ["python3", "/workflow/code/step.py"]\n'
    # [[steps.expect]] tables belong to the step: they come before the servers' tables.
    (wf / "workflow.toml").write_text(head + MCP_EXPECT + MCP_SERVERS)
    (wf / "code" / "step.py").write_text(textwrap.dedent(MCP_STEP))
    verification = verify_step(wf, "step1")
    remembers, reads_time, no_delete, relations, status = verification.results
    assert remembers.ok and '"mcp:memory/create_entities"' in remembers.evidence[0]
    assert reads_time.ok and '"decision":"allow"' in reads_time.evidence[0]
    assert no_delete.ok and status.ok
    assert not relations.ok and relations.happened == "0 matching call(s)"
    assert verification.digest.stubbed == {"mcp:memory/create_entities": 1}


def test_code_changed_while_the_step_ran_verifies_nothing(
    engine: DockerClient, tmp_path: Path
) -> None:
    """The workflow folder is live in the step's view: a change to `code/` during the
    run means the run tested something its content hash does not name."""
    import threading
    import time

    from sandbox.verify.verifystep import verify_step

    wf = write_workflow(
        tmp_path,
        command=["python3", "/workflow/code/step.py"],
        extra_toml='[[steps.expect]]\nkind = "status"\n',
    )
    (wf / "code" / "flag.txt").write_text("wait")
    (wf / "code" / "step.py").write_text(
        textwrap.dedent(
            """
            import pathlib, time
            end = time.monotonic() + 60
            while pathlib.Path("/workflow/code/flag.txt").read_text() != "go":
                assert time.monotonic() < end, "the flag never changed"
                time.sleep(0.05)
            """
        )
    )

    def change_once_the_run_started() -> None:
        end = time.monotonic() + 120
        while not list((wf / "runs").glob("test-*/test_mode.json")):
            assert time.monotonic() < end
            time.sleep(0.05)
        (wf / "code" / "flag.txt").write_text("go")

    changer = threading.Thread(target=change_once_the_run_started)
    changer.start()
    verification = verify_step(wf, "step1")
    changer.join()
    status, content = verification.results
    assert status.ok, status
    assert not verification.passed
    assert content.label == "content unchanged during the run"
    assert content.happened == "changed during the run (code/flag.txt)"


def test_an_unsealed_log_is_refused_by_verify_gate_and_report(
    engine: DockerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real run's record says the runner sealed its log; the same record without the
    seal (a runner that never reached collect, a record from before the seal) passes
    nothing: the verdict, the gate (both rules) and the report refuse it, show warns."""
    wf = write_workflow(
        tmp_path,
        command="echo quiet",
        extra_toml='\n[[steps.expect]]\nkind = "no_call"\ntool = "send_email"\n',
    )
    assert main(["verify", str(wf), "step1"]) == 0
    run_id = capsys.readouterr().out.split("(test run ")[1].split(")")[0]
    run_root = RunLayout(wf, run_id, "g").root
    record = read_record(run_root)
    assert record.log_synced_at is not None and record.log_synced_at >= record.started_at
    assert main(["gate", str(wf), "step1"]) == 0
    capsys.readouterr()

    write_record(run_root, record.model_copy(update={"log_synced_at": None}))
    refused = judge(FinishedStep.load(run_root), with_implicit_status([]))
    assert not refused.passed
    assert refused.results[0].happened == "not verified: the action log was not sealed"
    assert main(["gate", str(wf), "step1"]) == 1
    assert "not verified: the action log was not sealed" in capsys.readouterr().out
    assert main(["gate", str(wf), "step1", "--allow-no-effects"]) == 1
    assert "not verified: the action log was not sealed" in capsys.readouterr().out
    page = tmp_path / "report.html"
    assert main(["report", str(run_root), "--html", str(page)]) != 0
    assert "not verified: the action log was not sealed" in capsys.readouterr().err
    assert not page.exists()
    assert main(["show", str(run_root)]) == 0
    assert "warning: not verified: the action log was not sealed" in capsys.readouterr().err


def test_verify_against_the_last_passing_verification(
    engine: DockerClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`verify --against last-passing`: the first verification has nothing to compare
    against (said, the verdict stands); after a fix, one object carries the verdict and
    what the fix changed against the last passing run, and the HTML report shows it."""
    wf = write_workflow(
        tmp_path,
        command=["python3", "/workflow/code/step.py"],
        extra_toml='[[steps.expect]]\nkind = "call"\ntool = "notify_user"\ncount = 1\n',
    )
    step = wf / "code" / "step.py"
    step.write_text("import agentworks_bridge as b\nb.call('notify_user', {'text': 'done'})\n")
    args = ["verify", str(wf), "step1", "--against", "last-passing"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("verdict: PASS: step step1")
    assert out[-1] == (
        "against last-passing: no passing verification of step1 to compare against "
        "(nothing compared; the verdict stands)"
    )
    first = FinishedStep.load(RunLayout(wf, out[0].split("test run ")[1][:-1], "g").root)

    step.write_text("import agentworks_bridge as b\nb.call('notify_user', {'text': 'all done'})\n")
    page = tmp_path / "report.html"
    assert main([*args, "--json", "--html", str(page)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"verification", "comparison"} and data["verification"]["passed"]
    comparison = data["comparison"]
    assert (comparison["run_a"], comparison["run_b"]) == (
        first.record.id,
        data["verification"]["run_id"],
    )
    assert [(c["tool"], c["arguments"]) for c in comparison["calls"]] == [
        ("notify_user", [{"path": "text", "a": "done", "b": "all done", "only_in": None}])
    ]
    html = page.read_text()
    assert f"What changed against {first.record.id}" in html
    assert "text &quot;done&quot; -&gt; &quot;all done&quot;" in html

    assert main(["verify", str(wf), "step1", "--against", "test-nothing"]) == ExitCode.CONFIG
    assert "no test_mode.json" in capsys.readouterr().err
