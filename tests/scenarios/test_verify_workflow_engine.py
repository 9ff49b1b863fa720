"""The job-board chain verified for real: per-step and chain-wide expectations, the
verdict's evidence citing the chain's action log, and the gate for the chain."""

from __future__ import annotations

import json
import shutil
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import xmlschema
from docker import DockerClient

import sandbox
from sandbox.cli import main
from sandbox.contracts.layout import is_test_run
from sandbox.contracts.wire import ActionLine
from sandbox.run.testrun import RunOptions
from sandbox.run.workflowrun import WorkflowOptions
from sandbox.verify.chaindiff import ChainComparison
from sandbox.verify.diff import ArgumentChange
from sandbox.verify.finished import FinishedChain
from sandbox.verify.gate import gate, gate_workflow
from sandbox.verify.verifyworkflow import verify_workflow
from sandbox.verify.workflow_verification import SCHEMA_PATH, WorkflowVerification
from tests import paths
from tests.conftest import tree_digest

REPO = paths.REPO
JOBBOARD = REPO / "examples" / "job-board"
JUNIT_XSD = paths.TESTS / "data" / "junit.xsd"
sys.path.insert(0, str(JOBBOARD / "fake_api"))
sys.path.insert(0, str(REPO / "examples"))
from harness import FakeJobBoard, fake_jobboard  # noqa: E402
from setup import ensure_db  # noqa: E402

pytestmark = pytest.mark.engine

CHAIN_FILE = "expect/chain.toml"
TWO_MESSAGES = """name = "two client messages would have been sent across the chain"
kind = "call"
tool = "send_slack_message"
count = 2"""


@pytest.fixture
def fake(engine: DockerClient) -> Iterator[FakeJobBoard]:
    with fake_jobboard(engine) as board:
        yield board


@pytest.fixture
def jobboard(tmp_path: Path) -> Path:
    wf = tmp_path / "job-board"
    shutil.copytree(
        JOBBOARD,
        wf,
        ignore=shutil.ignore_patterns("test-*", "db.sqlite*", "__pycache__", "*.jsonl"),
    )
    ensure_db(wf)
    return wf


def real_tree(wf: Path) -> dict[str, str]:
    """The workflow folder's digest without the verification histories sandbox keeps."""
    return {k: v for k, v in tree_digest(wf).items() if not k.endswith("verifications.jsonl")}


def chain_log(wf: Path, verification: WorkflowVerification) -> list[str]:
    return (wf / "runs" / verification.run_id / "test_mode_actions.jsonl").read_text().splitlines()


def test_the_job_board_chain_verifies_and_the_gate_holds_until_a_step_changes(
    engine: DockerClient,
    fake: FakeJobBoard,
    jobboard: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = real_tree(jobboard)
    junit, page = tmp_path / "chain.xml", tmp_path / "chain.html"
    blocked = gate_workflow(jobboard, CHAIN_FILE)
    assert not blocked.ok and blocked.reason.endswith("has no passing verification")

    args = ["verify-workflow", str(jobboard), CHAIN_FILE, "--upstream-network", fake.network]
    code = main([*args, "--json", "--junit", str(junit), "--html", str(page)])
    verification = WorkflowVerification.model_validate_json(capsys.readouterr().out)
    assert code == 0, "\n".join(verification.lines())
    assert verification.passed and verification.chain_steps == [
        "bid-pick-job",
        "bid-submit",
        "outreach",
    ]
    assert real_tree(jobboard) == before  # the real folder and DB
    assert fake.state()["proposals"] == [] and fake.state()["messages"] == []

    # The verdict on disk validates against the published schema.
    saved = jobboard / "runs" / verification.run_id / "verification.json"
    jsonschema.validate(json.loads(saved.read_text()), json.loads(SCHEMA_PATH.read_text()))
    assert FinishedChain.load(saved.parent).verification == verification

    # Per step: bid-submit updated the row bid-pick-job inserted, in the chain's copy.
    submit = {r.label: r for r in verification.steps[1].results}
    row = submit["updates the row bid-pick-job inserted to submitted"]
    assert row.ok and row.evidence[0].startswith("db proposals updated row: id=42")
    # Chain-wide evidence is the chain's action log, each citation naming its step,
    # and the cited line is that line of the file.
    chain = {r.label: r for r in verification.chain}
    one = chain["one proposal would have been submitted across the chain"]
    assert one.ok and one.happened == "1 matching call(s)"
    lines = chain_log(jobboard, verification)
    cited = one.evidence[0]
    assert cited.startswith("action log line ") and " (step bid-submit): " in cited
    number = int(cited.removeprefix("action log line ").split(" ", 1)[0])
    line = ActionLine.model_validate_json(lines[number - 1])
    assert line.step == "bid-submit" and line.tool == "upwork_submit_proposal"
    assert chain["only outreach messages anyone"].happened == "never tried"
    claim = chain["the bids folder ends with the claim"]
    assert claim.ok and claim.evidence == ["the chain's records, group bids: claim.json created"]

    # The same verdict as JUnit (a suite per step and one for the chain) and HTML.
    xmlschema.XMLSchema(JUNIT_XSD).validate(junit)
    suites = ET.parse(junit).getroot().findall("testsuite")
    assert [s.get("name", "").rsplit("/", 1)[-1] for s in suites] == [
        "bid-pick-job",
        "bid-submit",
        "outreach",
        "sandbox verify-workflow job-board (chain)",
    ]
    assert not ET.parse(junit).getroot().findall("testsuite/testcase/failure")
    html = page.read_text()
    total = sum(len(s.results) for s in verification.steps) + len(verification.chain)
    assert total == 5 + 5 + 8 + 10  # every step's, and the chain's
    assert f"PASS: {total} of {total} expectation(s) held" in html
    assert "Stubbed actions of the chain" in html

    # The gate: the chain at every step's current version, and a step's own gate
    # counts the chain's verification of its own expectations.
    assert gate_workflow(jobboard, CHAIN_FILE).ok
    assert main(["gate", str(jobboard), "--workflow", CHAIN_FILE]) == 0
    assert capsys.readouterr().out.startswith(
        "gate: ok: the chain bid-pick-job -> bid-submit -> outreach (expect/chain.toml) verified"
    )
    assert gate(jobboard, "bid-pick-job").ok
    assert not gate(jobboard, "bid-submit").ok  # the file did not take its own expectations

    # One byte of outreach's code changed: the chain's verification no longer counts
    # (every step's hash takes every file of the workflow's code/).
    code_file = jobboard / "code" / "outreach.py"
    source = code_file.read_bytes()
    code_file.write_bytes(source.replace(b"15 minutes", b"16 minutes", 1))
    assert main(["gate", str(jobboard), "--workflow", CHAIN_FILE]) == 1
    assert capsys.readouterr().out == (
        "gate: blocked: the chain bid-pick-job -> bid-submit -> outreach (expect/chain.toml) "
        "changed since its last verification (bid-pick-job: code/outreach.py; "
        "bid-submit: code/outreach.py; outreach: code/outreach.py)\n"
    )
    # The expectations changed: blocked too.
    code_file.write_bytes(source)
    expect = jobboard / CHAIN_FILE
    expect.write_text(expect.read_text().replace(TWO_MESSAGES, TWO_MESSAGES + "\nat_most = 9"))
    with pytest.raises(Exception, match="give count, or at_least/at_most, not both"):
        gate_workflow(jobboard, CHAIN_FILE)


def test_a_chain_expectation_that_does_not_hold_fails_with_its_evidence(
    engine: DockerClient,
    fake: FakeJobBoard,
    jobboard: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    expect = jobboard / CHAIN_FILE
    text = expect.read_text()
    assert TWO_MESSAGES in text
    expect.write_text(
        text.replace(
            TWO_MESSAGES,
            TWO_MESSAGES.replace("two client messages", "one client message").replace(
                "count = 2", "count = 1"
            ),
        )
    )
    args = ["verify-workflow", str(jobboard), CHAIN_FILE, "--upstream-network", fake.network]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert out.startswith("verdict: FAIL: workflow job-board (bid-pick-job -> bid-submit -> ")
    failing = [line for line in out.splitlines() if line.startswith("  FAIL ")]
    assert len(failing) == 1, out
    assert failing[0].startswith(
        "  FAIL one client message would have been sent across the chain: expected "
        "send_slack_message would have run exactly 1 time(s) (across the chain); "
        "2 matching call(s) [action log line "
    )
    assert " (step outreach): " in failing[0] and '"tool":"send_slack_message"' in failing[0]

    runs = sorted(p for p in (jobboard / "runs").iterdir() if is_test_run(p.name))
    verification = FinishedChain.load(runs[-1]).verification
    assert verification is not None and not verification.passed
    assert verification.failed == [
        "chain: one client message would have been sent across the chain"
    ]
    assert all(step.passed for step in verification.steps)
    result = next(r for r in verification.chain if not r.ok)
    assert len(result.evidence) == 2 and all("(step outreach)" in e for e in result.evidence)
    blocked = gate_workflow(jobboard, CHAIN_FILE)
    assert not blocked.ok and "its last verification at the current version failed" in (
        blocked.reason
    )
    assert main(["list", str(jobboard)]) == 0
    listed = capsys.readouterr().out
    assert "workflow verifications (oldest first):" in listed
    assert (
        "bid-pick-job -> bid-submit -> outreach  expect/chain.toml  FAIL: chain: one client "
        "message would have been sent across the chain  test-"
    ) in listed


def test_a_step_that_never_ran_fails_its_expectations_saying_why(
    engine: DockerClient, tmp_path: Path
) -> None:
    """The middle step fails, so the chain stops: the last step's expectations fail as
    not run (naming why), the failing step's implicit status fails, the chain's too."""
    wf = tmp_path / "wf"
    (wf / "code").mkdir(parents=True)
    (wf / "code" / "tell.py").write_text(
        "import agentworks_bridge as b\nb.call('notify_user', {'text': 'done'})\n"
    )
    (wf / "workflow.toml").write_text(
        'name = "wf"\n'
        + "".join(
            f'[[steps]]\nid = "{step}"\ngroup = "g"\ncommand = {command}\ntimeout_s = 60\n'
            for step, command in (
                ("first", '["true"]'),
                ("breaks", '["false"]'),
                ("tells", '["python3", "/workflow/code/tell.py"]'),
            )
        )
    )
    (wf / "chain.toml").write_text(
        '[[steps]]\nid = "breaks"\n[[steps.expect]]\nkind = "no_call"\ntool = "send_email"\n'
        '[[steps]]\nid = "tells"\n[[steps.expect]]\nname = "tells"\nkind = "call"\n'
        'tool = "notify_user"\n'
        '[[expect]]\nname = "told once"\nkind = "call"\ntool = "notify_user"\ncount = 1\n'
    )
    verification = verify_workflow(wf, "chain.toml")
    assert not verification.passed
    by_step = {s.step_id: s for s in verification.steps}
    assert by_step["first"].results == [] and by_step["first"].passed  # named by no table
    breaks = {r.label: r for r in by_step["breaks"].results}
    assert breaks["send_email is never tried"].ok
    status = breaks["status passed (no status expectation given)"]
    assert not status.ok and status.happened.startswith("status failed, exit code 1")
    (tells,) = by_step["tells"].results[:1]
    assert not tells.ok and tells.happened == (
        "not judged: step tells did not run (skipped: step breaks did not pass (failed))"
    )
    chain = {r.label: r for r in verification.chain}
    assert chain["told once"].happened == "0 matching call(s)"
    assert chain["the chain passed (no chain status expectation given)"].happened.startswith(
        "chain status failed (step breaks failed"
    )


def test_a_chains_diff_names_the_step_a_fix_changed(
    engine: DockerClient,
    fake: FakeJobBoard,
    jobboard: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The chain verified with bid-submit spending 15 Connects (its expectation of 16
    fails), then with the fix: the diff of the two chain runs names bid-submit alone,
    its `connects` argument first, then the expectation the fix made hold."""
    options = WorkflowOptions(step=RunOptions(upstream_networks=(fake.network,)))
    code = jobboard / "code" / "bid-submit.py"
    fixed = code.read_text()
    assert '"connects": CONNECTS}' in fixed
    code.write_text(fixed.replace('"connects": CONNECTS}', '"connects": CONNECTS - 1}'))
    before = verify_workflow(jobboard, CHAIN_FILE, options)
    code.write_text(fixed)
    after = verify_workflow(jobboard, CHAIN_FILE, options)
    assert not before.passed and before.failed == [
        "bid-submit: submits the claimed job's proposal once"
    ]
    assert after.passed, "\n".join(after.lines())
    roots = [jobboard / "runs" / v.run_id for v in (before, after)]

    result = sandbox.compare(*roots)
    assert isinstance(result, ChainComparison)
    assert result.changed_steps == ["bid-submit"] and result.expectations_compared
    (submit,) = [s.comparison for s in result.steps if s.step_id == "bid-submit"]
    assert submit is not None
    assert [(c.change, c.tool) for c in submit.calls] == [("changed", "upwork_submit_proposal")]
    assert submit.calls[0].arguments == [ArgumentChange(path="connects", a=15, b=16)]
    assert [(e.label, e.a, e.b) for e in submit.expectations] == [
        ("submits the claimed job's proposal once", False, True)
    ]
    assert not (result.fields or result.db or result.db_summary or result.expectations)

    assert main(["diff", *map(str, roots)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith(
        "first divergence: step bid-submit: call changed: upwork_submit_proposal at A #"
    )
    assert out[2].endswith(": connects 15 -> 16") and out[3] == "2 difference(s):"
    assert out[5] == (
        '  step bid-submit: expectation "submits the claimed job\'s proposal once": failed -> held'
    )
    assert fake.state()["proposals"] == []
