"""`sandbox verify` then `sandbox gate` on the real engine: the gate is bound to files outside
`code/`, accepts only a verification run with every wall, and test mode writes nothing
outside `runs/test-*`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.cli import main
from sandbox.contracts.testknobs import weakened_for_tests
from sandbox.verify import history
from sandbox.verify.gate import gate
from sandbox.verify.verifystep import verify_step
from tests.conftest import WorkflowFactory, tree_digest

pytestmark = pytest.mark.engine

STEP = """\
import json, sys
sys.path.insert(0, "/workflow/lib")
import helper
settings = json.load(open("/workflow/config/bid.json"))
print("proposals", helper.N * settings["proposals"])
"""


def _workflow(make_workflow: WorkflowFactory) -> Path:
    wf = make_workflow(
        command=["python3", "/workflow/scripts/bid.py"],
        db_sql=None,
        extra_toml='[[steps.expect]]\nkind = "status"\nexit_code = 0\n',
    )
    for rel, text in (
        ("scripts/bid.py", STEP),
        ("lib/helper.py", "N = 1\n"),
        ("config/bid.json", json.dumps({"proposals": 1})),
    ):
        (wf / rel).parent.mkdir(exist_ok=True)
        (wf / rel).write_text(text)
    return wf


def test_verify_then_a_change_outside_code_blocks_the_gate(
    engine: DockerClient, make_workflow: WorkflowFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    wf = _workflow(make_workflow)
    before = tree_digest(wf)
    assert main(["verify", str(wf), "step1"]) == 0, capsys.readouterr().out
    # Test mode wrote nothing outside runs/test-*: the history is under one too.
    assert tree_digest(wf) == before
    assert (wf / "runs" / "test-verifications" / "verifications.jsonl").is_file()
    capsys.readouterr()
    assert main(["gate", str(wf), "step1"]) == 0
    assert capsys.readouterr().out.startswith("gate: ok: step1 verified at its current version")

    (wf / "config" / "bid.json").write_text(json.dumps({"proposals": 2}))
    assert main(["gate", str(wf), "step1"]) == 1
    assert capsys.readouterr().out == (
        "gate: blocked: step1 changed since its last verification (config/bid.json)\n"
    )


def test_a_verification_run_without_its_firewall_is_refused_by_the_gate(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    """A run planned without its firewall (only the project's tests can: the public
    RunOptions has no such knob) says so in its record, and never verifies the step (here
    the preflight catches the open namespace too; a passing history line with weaker walls
    is refused as well: tests/verify/test_gate.py)."""
    wf = _workflow(make_workflow)
    with weakened_for_tests(install_firewall=False):
        verification = verify_step(wf, "step1")
    walls = verification.walls
    assert walls is not None and not walls.firewall and not walls.full
    assert "no firewall (it was turned off for this run)" in walls.lacking
    [entry] = history.read(wf, "step1")
    assert entry.walls == walls
    assert not gate(wf, "step1").ok
    # The same step verified with every wall passes.
    verification = verify_step(wf, "step1")
    assert verification.passed, "\n".join(verification.lines())
    walls = verification.walls
    assert walls is not None and walls.full and walls.firewall and walls.seccomp, walls
    assert walls.lacking == []
    assert gate(wf, "step1").ok
