"""Step bid-submit: draft a proposal, submit it (spends Connects), confirm, mark it submitted.

Why it is in the example: `upwork_submit_proposal` and the browser click are
the effects test mode must stub. The stub reply ("TEST MODE: ... was NOT run")
is an ok reply, so this script carries on exactly as after a real submission.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jobboard_steps import call, rows, run, stubbed, text

CONNECTS = 16
FALLBACK_JOB_ID = 42  # the job bid-pick-job claims when this DB has no claimed row yet


def main() -> None:
    claimed = rows(
        call(
            "query_workflow_db",
            {
                "sql": "SELECT id, job_id, status FROM proposals "
                "WHERE status = 'claimed' ORDER BY id LIMIT 1"
            },
        )
    )
    if claimed:
        proposal_id, job_id = int(claimed[0][0]), int(claimed[0][1])
        print(f"claimed proposals row {proposal_id} for job {job_id}")
    else:
        proposal_id = job_id = FALLBACK_JOB_ID
        print(f"no claimed proposals row in this DB; bidding on job {job_id}")

    job = rows(
        call(
            "query_workflow_db",
            {"sql": "SELECT title, budget FROM jobs WHERE id = ?", "params": [job_id]},
        )
    )
    title, budget = (str(job[0][0]), job[0][1]) if job else (f"job {job_id}", "?")
    claim = Path("claim.json")
    notes = json.loads(claim.read_text()) if claim.is_file() else {}

    draft = text(
        call(
            "generate_text_llm",
            {
                "prompt": f"Write a short, friendly Upwork proposal for the job {title!r} "
                f"(budget {budget}). Notes: {json.dumps(notes)}"
            },
        )
    ).strip()

    submitted = call(
        "upwork_submit_proposal", {"job_id": job_id, "text": draft, "connects": CONNECTS}
    )
    clicked = call("agent_browser", {"command": "click #submit"})

    call(
        "mutate_workflow_db",
        {
            "sql": "INSERT INTO proposals (id, job_id, status, text) VALUES (?, ?, 'submitted', ?) "
            "ON CONFLICT(id) DO UPDATE SET status = 'submitted', text = excluded.text",
            "params": [proposal_id, job_id, draft],
        },
    )

    how = "stubbed (test mode)" if stubbed(submitted) else "submitted"
    Path("proposal.md").write_text(
        f"# Proposal for job {job_id}: {title}\n\n{draft}\n\n"
        f"- submission: {how}; {CONNECTS} Connects\n"
        f"- confirm click: {'stubbed (test mode)' if stubbed(clicked) else 'done'}\n"
        f"- claim: {'claim.json of bid-pick-job' if notes else 'none in this run folder'}\n"
    )
    print(f"proposal for job {job_id} {how}; row {proposal_id} marked submitted -> proposal.md")


if __name__ == "__main__":
    sys.exit(run(main))
