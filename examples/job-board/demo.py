"""`make demo`: verify the job-board example's bid-submit step in test mode.

Starts the fake job-board API (the step's bridge upstream) in its own
container, runs the step once through `sandbox.verify_step`, prints the
record's summary (every stubbed action first), shows that nothing with an
effect reached the fake API and that the real DB is unchanged, and ends with
the verdict over the step's expectations (in workflow.toml).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "fake_api"))
sys.path.insert(0, str(HERE.parent))

import docker  # noqa: E402
from harness import fake_jobboard, outside_world_lines  # noqa: E402
from setup import ensure_db  # noqa: E402

from sandbox import RunOptions, verify_step  # noqa: E402
from sandbox.contracts.record import read_record  # noqa: E402


def main(step: str = "bid-submit") -> int:
    db = ensure_db(HERE)
    assert db is not None
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    client = docker.from_env()
    with fake_jobboard(client) as fake:
        options = RunOptions(upstream_networks=(fake.network,))
        verification = verify_step(HERE, step, options)
        state = fake.state()
    record = read_record(HERE / "runs" / verification.run_id)
    for line in record.summary_lines():
        print(line)
    print(f"record: {HERE / 'runs' / record.id / 'test_mode.json'}")
    print("--- step output (tail) ---")
    print(record.stdout.text.rstrip())
    if record.stderr.text.strip():
        print("--- step stderr (tail) ---")
        print(record.stderr.text.rstrip())
    print("--- the outside world afterwards ---")
    for line in outside_world_lines(state):
        print(line)
    same = hashlib.sha256(db.read_bytes()).hexdigest() == before
    print(f"real workflow DB unchanged: {same}")
    print("--- verification ---")
    for line in verification.lines():
        print(line)
    return 0 if verification.passed and same else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
