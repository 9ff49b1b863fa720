"""Step bid-pick-job: pick the first open shortlisted job, read its page, claim it.

Why it is in the example: claiming writes the workflow DB (a proposals row and
the job's status), which test mode must redirect into the test run's copy,
while the browser reads (open, get text) stay real.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from jobboard_steps import call, rows, run, text

PROPOSAL_ID = 42
JOB_URL = "https://jobs.example.org/{id}"


def main() -> None:
    shortlist = json.loads(Path("shortlist.json").read_text())
    job_ids = [int(j) for j in shortlist.get("job_ids", [])]
    print(f"shortlist from the last run: {job_ids}")

    found = rows(
        call(
            "query_workflow_db",
            {"sql": "SELECT id, title FROM jobs WHERE status = 'open' ORDER BY id LIMIT 1"},
        )
    )
    if not found:
        print("no open job in the DB: nothing to claim")
        return
    job_id, title = int(found[0][0]), str(found[0][1])
    if job_id not in job_ids:
        print(f"note: job {job_id} was not on the shortlist")

    call("agent_browser", {"command": f"open {JOB_URL.format(id=job_id)}"})
    page = text(call("agent_browser", {"command": "get text"}))
    budget = next((line for line in page.splitlines() if line.startswith("Budget")), "")

    call(
        "mutate_workflow_db",
        {
            "sql": "INSERT INTO proposals (id, job_id, status) VALUES (42, ?, 'claimed')",
            "params": [job_id],
        },
    )
    call(
        "mutate_workflow_db",
        {"sql": "UPDATE jobs SET status = 'claimed' WHERE id = ?", "params": [job_id]},
    )

    claim = {
        "job_id": job_id,
        "title": title,
        "proposal_id": PROPOSAL_ID,
        "budget": budget,
        "test_mode": os.environ.get("AGENTWORKS_TEST_MODE") == "1",
    }
    Path("claim.json").write_text(json.dumps(claim, indent=2) + "\n")
    print(f"claimed job {job_id} ({title}; {budget or 'budget unknown'}) -> claim.json")


if __name__ == "__main__":
    sys.exit(run(main))
