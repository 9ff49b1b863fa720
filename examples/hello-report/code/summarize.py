"""Example step: read the DB copy and an earlier run's notes, write a report.

In test mode $DB_PATH names the test run's copy, so the UPDATE below changes
the copy only; the real workflow DB stays as it was.
"""

import json
import os
import sqlite3
from pathlib import Path

test_mode = os.environ.get("AGENTWORKS_TEST_MODE") == "1"
prompt = (
    Path(os.environ["AGENTWORKS_PROMPT_FILE"]).read_text()
    if "AGENTWORKS_PROMPT_FILE" in os.environ
    else ""
)
notes = json.loads(Path("data/notes.json").read_text())

db = sqlite3.connect(os.environ["DB_PATH"])
rows = db.execute(
    "SELECT id, customer, amount FROM orders WHERE status = 'open' ORDER BY id"
).fetchall()
lines = ["# Open orders", ""]
for order_id, customer, amount in rows:
    lines.append(f"- #{order_id} {customer}: {amount:.2f} ({notes.get(customer, 'no notes')})")
Path("report.md").write_text("\n".join(lines) + "\n")
db.execute("UPDATE orders SET status = 'summarized' WHERE status = 'open'")
db.commit()

print(f"test mode: {test_mode}; prompt has TEST MODE section: {'## TEST MODE' in prompt}")
print(f"summarized {len(rows)} open order(s) into report.md")
