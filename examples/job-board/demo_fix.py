"""What a fix changed, and its verification replayed: the job-board's bid-submit step.

In a copy of this example (the example itself is not touched): the bug submits the
proposal with 15 Connects; the fix with 16. Both versions run once in test mode
against the fake job-board API, and `sandbox.compare` names what the fix does
differently in the real world: the submission's `connects` argument, nothing
else. Then the fake API is stopped and the fix is verified again with its reads
(the model call) answered from the fixed run's recording: the verdict is the
same, and it says it was replayed, so the gate does not take it for a live one.

    .venv/bin/python examples/job-board/demo_fix.py [FOLDER]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "fake_api"))
sys.path.insert(0, str(HERE.parent))

import docker  # noqa: E402
from harness import fake_jobboard  # noqa: E402
from setup import ensure_db  # noqa: E402

from sandbox import RunOptions, TestRun, compare, verify_step  # noqa: E402
from sandbox.verify.gate import gate  # noqa: E402

FIXED = '"connects": CONNECTS}'  # the fix: the submission spends CONNECTS (16)
BUG = '"connects": 15}'  # the bug: a stale 15


def main(folder: str | None = None) -> int:
    work = Path(folder or tempfile.mkdtemp(prefix="job-board-fix-")) / "job-board"
    shutil.copytree(HERE, work, ignore=shutil.ignore_patterns("test-*", "db.sqlite*", "*.pyc"))
    ensure_db(work)
    code = work / "code" / "bid-submit.py"
    fixed = code.read_text()
    assert FIXED in fixed
    with fake_jobboard(docker.from_env()) as fake:
        live = RunOptions(upstream_networks=(fake.network,))
        code.write_text(fixed.replace(FIXED, BUG))
        before = TestRun(work, "bid-submit", live).execute()
        code.write_text(fixed)
        after = verify_step(work, "bid-submit", live)
    runs = work / "runs"
    print(f"--- sandbox diff {before.id} {after.run_id} ---")
    result = compare(runs / before.id, runs / after.run_id)
    for line in result.lines():
        print(line)
    print("--- the fake job-board API is stopped: the fix verified again, replayed ---")
    replayed = verify_step(work, "bid-submit", RunOptions(replay=after.run_id))
    for line in replayed.lines():
        print(line)
    print(f"--- sandbox gate (the live verification {after.run_id} is what it accepts) ---")
    print(gate(work, "bid-submit").reason)
    return 0 if after.passed and replayed.passed and not result.same else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
