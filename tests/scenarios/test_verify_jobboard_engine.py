"""The job-board example verified for real, and the gate bound to the exact code tested."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker import DockerClient

import sandbox
from sandbox.cli import main
from sandbox.contracts.layout import RunLayout
from sandbox.run.testrun import RunOptions, TestRun
from sandbox.verify.diff import ArgumentChange, RunComparison
from sandbox.verify.gate import gate
from sandbox.verify.verifystep import verify_step
from tests import paths
from tests.conftest import write_workflow

REPO = paths.REPO
JOBBOARD = REPO / "examples" / "job-board"
sys.path.insert(0, str(JOBBOARD / "fake_api"))
sys.path.insert(0, str(REPO / "examples"))
from harness import FakeJobBoard, fake_jobboard  # noqa: E402
from setup import ensure_db  # noqa: E402

pytestmark = pytest.mark.engine

SUBMIT_CALL = """    submitted = call(
        "upwork_submit_proposal", {"job_id": job_id, "text": draft, "connects": CONNECTS}
    )"""


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


def test_the_job_board_steps_verify(
    engine: DockerClient, fake: FakeJobBoard, jobboard: Path
) -> None:
    options = RunOptions(upstream_networks=(fake.network,))
    for step in ("bid-pick-job", "bid-submit", "outreach"):
        verification = verify_step(jobboard, step, options)
        assert verification.passed, "\n".join(verification.lines())
    assert fake.state()["proposals"] == [] and fake.state()["messages"] == []
    lines = "\n".join(verification.lines())
    assert (
        "PASS messages nobody else: expected send_slack_message would have run exactly 2" in lines
    )


def test_a_step_that_skips_its_submit_fails_and_one_byte_flips_the_gate(
    engine: DockerClient,
    fake: FakeJobBoard,
    jobboard: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = RunOptions(upstream_networks=(fake.network,))
    code = jobboard / "code" / "bid-submit.py"
    assert gate(jobboard, "bid-submit").reason == "bid-submit has no passing verification"

    assert verify_step(jobboard, "bid-submit", options).passed
    assert main(["gate", str(jobboard), "bid-submit"]) == 0
    assert capsys.readouterr().out.startswith(
        "gate: ok: bid-submit verified at its current version"
    )

    # One byte of the step's code changed: the verification no longer counts.
    source = code.read_bytes()
    code.write_bytes(source.replace(b"CONNECTS = 16", b"CONNECTS = 15", 1))
    assert main(["gate", str(jobboard), "bid-submit"]) == 1
    assert capsys.readouterr().out == (
        "gate: blocked: bid-submit changed since its last verification (code/bid-submit.py)\n"
    )
    code.write_bytes(source)
    assert main(["gate", str(jobboard), "bid-submit"]) == 0
    capsys.readouterr()

    # The step that silently stopped submitting exits 0, and fails its verification.
    text = source.decode()
    assert SUBMIT_CALL in text
    code.write_text(text.replace(SUBMIT_CALL, '    submitted = {"decision": "stub"}'))
    verification = verify_step(jobboard, "bid-submit", options)
    assert verification.digest.status == "passed" and not verification.passed
    by = {r.label: r for r in verification.results}
    submit = by["submits the proposal once"]
    assert not submit.ok and submit.happened == "0 matching call(s)"
    assert by["confirms with a click after submitting"].happened.endswith(
        "'submits the proposal once' matched no call, so the order cannot hold"
    )
    assert main(["gate", str(jobboard), "bid-submit"]) == 1
    assert "bid-submit's last verification at its current version failed" in capsys.readouterr().out


def test_gate_without_effects_only_when_the_caller_allows_it(
    engine: DockerClient, tmp_path: Path
) -> None:
    wf = write_workflow(tmp_path, command="echo quiet")
    assert TestRun(wf, "step1").execute().status.value == "passed"
    assert not gate(wf, "step1").ok
    allowed = gate(wf, "step1", allow_no_effects=True)
    assert allowed.ok and allowed.reason.startswith("step1 showed no external effect in 1 test run")
    (wf / "code" / "noisy.py").write_text(
        "import agentworks_bridge as b\nb.call('notify_user', {})\n"
    )
    changed = gate(wf, "step1", allow_no_effects=True)
    assert not changed.ok
    assert changed.reason.endswith("no test run at its current version to show it has no effects")
    (wf / "workflow.toml").write_text(
        (wf / "workflow.toml")
        .read_text()
        .replace('"echo quiet"', '"python3 /workflow/code/noisy.py"')
    )
    assert TestRun(wf, "step1").execute().status.value == "passed"
    noisy = gate(wf, "step1", allow_no_effects=True)
    assert not noisy.ok and "showed an external effect: 1 stubbed call(s)" in noisy.reason


def test_the_claiming_step_has_effects_though_every_write_went_to_the_copy(
    engine: DockerClient,
    fake: FakeJobBoard,
    jobboard: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """bid-pick-job inserts a proposals row and claims a job, every write redirected into
    the test run's DB copy and no call stubbed: still not a step without effects."""
    record = TestRun(jobboard, "bid-pick-job", RunOptions(upstream_networks=(fake.network,)))
    done = record.execute()
    assert done.status.value == "passed", done.summary_lines()
    assert (done.actions.stub, done.actions.refuse, done.actions.redirect_write) == (0, 0, 2)
    assert main(["gate", str(jobboard), "bid-pick-job", "--allow-no-effects"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("gate: blocked: bid-pick-job has no passing verification; run ")
    assert "showed an external effect: DB write(s): jobs: 1 updated (id=42: " in out
    assert "; proposals: 1 inserted (id=42); " in out
    assert "2 redirected DB write(s) into the copy" in out
    assert fake.state()["proposals"] == []


def test_diff_of_two_runs_around_a_fix_names_the_connects_argument_alone(
    engine: DockerClient,
    fake: FakeJobBoard,
    jobboard: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The bug spends 15 Connects, the fix 16: the diff of the two test runs names the
    submission's `connects` argument, and nothing else the runs did."""
    options = RunOptions(upstream_networks=(fake.network,))
    code = jobboard / "code" / "bid-submit.py"
    fixed = code.read_text()
    assert '"connects": CONNECTS}' in fixed
    code.write_text(fixed.replace('"connects": CONNECTS}', '"connects": CONNECTS - 1}'))
    before = TestRun(jobboard, "bid-submit", options).execute()
    code.write_text(fixed)
    after = TestRun(jobboard, "bid-submit", options).execute()
    assert before.status.value == after.status.value == "passed"
    roots = [RunLayout(jobboard, r.id, "bids").root for r in (before, after)]

    result = sandbox.compare(*roots)
    assert isinstance(result, RunComparison)
    assert [(c.change, c.tool) for c in result.calls] == [("changed", "upwork_submit_proposal")]
    assert result.calls[0].arguments == [ArgumentChange(path="connects", a=15, b=16)]
    assert result.calls[0].decision_a == result.calls[0].decision_b == "stub"
    assert not (result.fields or result.db or result.db_summary or result.files or result.egress)
    assert result.content_a != result.content_b  # two versions of the step

    assert main(["diff", *map(str, roots)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("first divergence: call changed: upwork_submit_proposal at A #")
    assert out[2].endswith(": connects 15 -> 16") and out[3] == "1 difference(s):"
    assert fake.state()["proposals"] == []
