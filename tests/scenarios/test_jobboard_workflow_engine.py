"""The job-board example as one chain in test mode: pick -> submit -> outreach, on the real engine."""

from __future__ import annotations

import shutil
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.contracts.record import RunStatus, read_record
from sandbox.contracts.workflow_record import StepState
from sandbox.run.testrun import RunOptions
from sandbox.run.workflowrun import WorkflowOptions, WorkflowRun
from tests import paths
from tests.conftest import tree_digest

sys.path.insert(0, str(paths.REPO / "examples" / "job-board" / "fake_api"))
from harness import FakeJobBoard, fake_jobboard

pytestmark = pytest.mark.engine

JOBBOARD = paths.REPO / "examples" / "job-board"
CHAIN = ["bid-pick-job", "bid-submit", "outreach"]


@pytest.fixture
def fake(engine: DockerClient) -> Iterator[FakeJobBoard]:
    with fake_jobboard(engine) as board:
        yield board


@pytest.fixture
def job_board(tmp_path: Path) -> Path:
    """A copy of the example (its DB made from the seed), so runs never touch the repo's."""
    wf = tmp_path / "job-board"
    shutil.copytree(
        JOBBOARD, wf, ignore=shutil.ignore_patterns("test-*", "db.sqlite*", "__pycache__")
    )
    sys.path.insert(0, str(JOBBOARD.parent))
    from setup import ensure_db

    ensure_db(wf)
    return wf


def test_the_chain_passes_its_effects_flow_and_nothing_leaves(
    engine: DockerClient, fake: FakeJobBoard, job_board: Path
) -> None:
    before = tree_digest(job_board)
    record = WorkflowRun(
        job_board, WorkflowOptions(step=RunOptions(upstream_networks=(fake.network,)))
    ).execute()
    assert record.status is RunStatus.PASSED, record.summary_lines()
    assert [s.step_id for s in record.steps] == CHAIN
    assert tree_digest(job_board) == before  # the real folder and DB, byte for byte
    state = fake.state()
    assert state["proposals"] == [] and state["messages"] == [] and state["clicks"] == []
    assert state["connects"] == 100

    root = job_board / "runs" / record.id
    submit = read_record((root / (record.steps[1].record or "")).parent)
    # bid-submit read the row bid-pick-job inserted into the chain's DB copy...
    assert "claimed proposals row 42 for job 42" in submit.stdout.text
    # ...and its claim.json through the bids group folder.
    proposal = (root / record.groups["bids"] / "proposal.md").read_text()
    assert "claim: claim.json of bid-pick-job" in proposal
    outreach = read_record((root / (record.steps[2].record or "")).parent)
    assert "latest submitted proposal: 42" in outreach.stdout.text
    copy = sqlite3.connect(f"file:{root / (record.db or '')}?mode=ro", uri=True)
    assert copy.execute("SELECT status FROM proposals WHERE id = 42").fetchone() == ("submitted",)
    copy.close()
    # Across the chain: one proposal would have been submitted, one owner note sent.
    tools = [(a.step_id, a.tool) for a in record.stubbed]
    assert tools.count(("bid-submit", "upwork_submit_proposal")) == 1
    assert tools.count(("outreach", "notify_user")) == 1
    assert record.db_diff is not None
    tables = {t.name: t for t in record.db_diff.tables}
    assert tables["proposals"].inserted == 1 and tables["jobs"].updated == 1


def test_a_failing_bid_submit_stops_the_chain_before_outreach(
    engine: DockerClient, fake: FakeJobBoard, job_board: Path
) -> None:
    (job_board / "code" / "bid-submit.py").write_text("raise SystemExit('no Connects left')\n")
    record = WorkflowRun(
        job_board, WorkflowOptions(step=RunOptions(upstream_networks=(fake.network,)))
    ).execute()
    assert record.status is RunStatus.FAILED
    assert [s.status for s in record.steps] == [
        StepState.PASSED,
        StepState.FAILED,
        StepState.SKIPPED,
    ]
    assert record.steps[2].reason == "step bid-submit did not pass (failed)"
    assert fake.state()["messages"] == []


def test_from_and_to_run_bid_submit_alone_on_the_real_dbs_copy(
    engine: DockerClient, fake: FakeJobBoard, job_board: Path
) -> None:
    record = WorkflowRun(
        job_board,
        WorkflowOptions(
            from_step="bid-submit",
            to_step="bid-submit",
            step=RunOptions(upstream_networks=(fake.network,)),
        ),
    ).execute()
    assert record.status is RunStatus.PASSED, record.summary_lines()
    assert [s.step_id for s in record.steps] == ["bid-submit"]
    submit = read_record((job_board / "runs" / record.id / (record.steps[0].record or "")).parent)
    # Nothing before it ran in this chain: no claimed row in the copy of the real DB.
    assert "no claimed proposals row in this DB" in submit.stdout.text
