"""`make demo-workflow`: the job-board example's whole chain once, in test mode.

bid-pick-job -> bid-submit -> outreach run as one test run and are judged against
`expect/chain.toml` (`sandbox.verify_workflow`) against the fake job-board API: the
proposals row bid-pick-job claims reaches bid-submit through the chain's DB copy,
and its claim.json through the bids group folder. Each guarded call is printed as
the guard logs it; then the chain's record (every stubbed action first), proof that
nothing reached the outside world and that the real DB is unchanged, and the
workflow verdict (per step and for the chain).
"""

from __future__ import annotations

import hashlib
import sqlite3
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "fake_api"))
sys.path.insert(0, str(HERE.parent))

import docker  # noqa: E402
from harness import fake_jobboard, outside_world_lines  # noqa: E402
from setup import ensure_db  # noqa: E402

from sandbox import RunOptions, WorkflowOptions, verify_workflow  # noqa: E402
from sandbox.contracts.workflow_record import WorkflowRunRecord, read_any_record  # noqa: E402
from sandbox.progress import FollowPrinter  # noqa: E402


def main() -> int:
    db = ensure_db(HERE)
    assert db is not None
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    client = docker.from_env()
    printer = FollowPrinter.for_stream(sys.stdout, as_json=False)
    with fake_jobboard(client) as fake:
        try:
            options = RunOptions(upstream_networks=(fake.network,), on_event=printer)
            verification = verify_workflow(HERE, "expect/chain.toml", WorkflowOptions(step=options))
        finally:
            printer.close()
        state = fake.state()
    root = HERE / "runs" / verification.run_id
    record = read_any_record(root)
    assert isinstance(record, WorkflowRunRecord)
    for line in record.summary_lines():
        print(line)
    print(f"record: {root / 'test_mode.json'}")
    if record.db is not None:
        copy = sqlite3.connect(f"file:{root / record.db}?mode=ro", uri=True)
        row = copy.execute("SELECT id, job_id, status FROM proposals WHERE id = 42").fetchone()
        copy.close()
        print(f"the chain's DB copy, proposals row 42: {row}")
    if "bids" in record.groups:
        proposal = root / record.groups["bids"] / "proposal.md"
        if proposal.is_file():
            print(f"--- {proposal.relative_to(HERE)} ---")
            print(proposal.read_text().rstrip())
    print("--- the outside world afterwards ---")
    for line in outside_world_lines(state):
        print(line)
    same = hashlib.sha256(db.read_bytes()).hexdigest() == before
    print(f"real workflow DB unchanged: {same}")
    print("--- the workflow verdict (expect/chain.toml) ---")
    for line in verification.lines():
        print(line)
    return 0 if verification.passed and same else 1


if __name__ == "__main__":
    sys.exit(main())
