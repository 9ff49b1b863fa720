"""Step outreach: message each client on Slack, then tell the owner.

Why it is in the example: every call here is messaging, which test mode
stubs and records; none of it may reach the job board's message log. The owner's
note names the newest submitted proposal from the DB: in a whole-workflow test
run, the one bid-submit marked in the chain's DB copy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jobboard_steps import call, rows, run, stubbed


def main() -> None:
    contacts = json.loads(Path("contacts.json").read_text())
    print(f"{len(contacts)} contact(s) from the last run")
    lines = ["# Outreach", ""]
    for contact in contacts:
        name, handle = str(contact["name"]), str(contact["slack"])
        first = name.split()[0]
        reply = call(
            "send_slack_message",
            {
                "channel": handle,
                "text": f"Hi {first}, thanks for posting your project. "
                "I'd be glad to help; do you have 15 minutes this week?",
            },
        )
        lines.append(f"- {name} ({handle}): {'stubbed (test mode)' if stubbed(reply) else 'sent'}")
    names = ", ".join(str(c["name"]) for c in contacts)
    latest = rows(
        call(
            "query_workflow_db",
            {
                "sql": "SELECT id, job_id FROM proposals WHERE status = 'submitted' "
                "ORDER BY id DESC LIMIT 1"
            },
        )
    )
    about = f"; latest proposal {latest[0][0]} (job {latest[0][1]})" if latest else ""
    print(f"latest submitted proposal: {latest[0][0] if latest else 'none'}")
    reply = call(
        "notify_user", {"text": f"Outreach: messaged {len(contacts)} client(s): {names}{about}"}
    )
    lines += ["", f"owner notified: {'stubbed (test mode)' if stubbed(reply) else 'yes'}"]
    Path("outreach.md").write_text("\n".join(lines) + "\n")
    print(f"messaged {len(contacts)} client(s) -> outreach.md")


if __name__ == "__main__":
    sys.exit(run(main))
