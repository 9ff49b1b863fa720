"""The gate is bound to the step's whole version, refuses what it cannot vouch for, and
keeps its history under `runs/test-*`: the real gate against real files, with the
verification history written the way `sandbox verify` writes it (the engine is asked only
for the images' ids; no container runs here)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.backends.docker.gc import GcReport, collect_host
from sandbox.cli import main
from sandbox.contracts.config import load_workflow
from sandbox.contracts.record import RECORD_FILE, ContentHash, RunStatus, TestRunRecord, Walls
from sandbox.verify import history
from sandbox.verify.gate import current_content, gate
from tests.conftest import write_workflow

pytestmark = pytest.mark.engine

FULL = Walls(firewall=True, seccomp=True, full=True)
TOML = """
[egress]
allow = ["api.example.com"]
[bridge]
default_budget_s = 30
[limits]
memory_mb = 512
"""


def _workflow(root: Path) -> Path:
    wf = write_workflow(root, command="python3 /workflow/scripts/bid.py", extra_toml=TOML)
    for rel, text in (
        ("scripts/bid.py", "import helper\n"),
        ("lib/helper.py", "N = 1\n"),
        ("config/bid.json", '{"proposals": 1}\n'),
        ("shared/cfg.py", "A = 1\n"),
    ):
        (wf / rel).parent.mkdir(exist_ok=True)
        (wf / rel).write_text(text)
    os.symlink("../shared/cfg.py", wf / "code" / "cfg.py")
    return wf


def _verified(wf: Path, walls: Walls | None = FULL, content: ContentHash | None = None) -> None:
    """A passing verification of step1 at its current version, as `sandbox verify` records it
    (beside its run's record, whose action log the runner sealed)."""
    workflow = load_workflow(wf)
    run_id = "test-20250101T000000-abcdef"
    now = datetime.now(UTC)
    run_root = wf / "runs" / run_id
    run_root.mkdir(parents=True, exist_ok=True)
    sealed = TestRunRecord(
        id=run_id,
        workflow_dir=str(wf),
        workflow_name="wf",
        step_id="step1",
        group="g",
        command="true",
        status=RunStatus.PASSED,
        started_at=now,
        log_synced_at=now,
    )
    (run_root / RECORD_FILE).write_text(sealed.model_dump_json())
    history.append_entry(
        wf,
        history.HistoryEntry(
            run_id=run_id,
            step_id="step1",
            at=now,
            passed=True,
            content=content or current_content(wf, workflow, workflow.step("step1")),
            expectations_digest="",
            walls=walls,
        ),
    )


def _edit(rel: str, old: str, new: str) -> Callable[[Path], None]:
    def change(wf: Path) -> None:
        path = wf / rel
        path.write_text(path.read_text().replace(old, new))

    return change


def _vendor(wf: Path) -> None:
    """A code/ tree of 21,000 entries; the change is to its last file."""
    for i in range(21_000):
        sub = wf / "code" / "node_modules" / f"p{i // 1000:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"m{i:05d}.js").write_text(f"{i}\n")


CASES = {
    "program outside code/": (_edit("scripts/bid.py", "helper", "helper, os"), "scripts/bid.py"),
    "helper in lib/": (_edit("lib/helper.py", "N = 1", "N = 2"), "lib/helper.py"),
    "settings file": (_edit("config/bid.json", "1", "2"), "config/bid.json"),
    "symlink target": (_edit("shared/cfg.py", "A = 1", "A = 2"), "code/cfg.py"),
    "[egress]": (
        _edit("workflow.toml", '"api.example.com"', '"api.example.com", "b.example.com"'),
        "workflow.toml [egress]",
    ),
    "[bridge]": (
        _edit("workflow.toml", "budget_s = 30", "budget_s = 31"),
        "workflow.toml [bridge]",
    ),
    "[limits]": (
        _edit("workflow.toml", "memory_mb = 512", "memory_mb = 513"),
        "workflow.toml [limits]",
    ),
    "past 20,000 entries": (
        _edit("code/node_modules/p20/m20999.js", "20999", "x"),
        "code/node_modules/p20/",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_change_anywhere_in_the_version_blocks_the_gate_and_is_named(
    engine: DockerClient, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    wf = _workflow(tmp_path)
    if case == "past 20,000 entries":
        _vendor(wf)
    _verified(wf)
    assert gate(wf, "step1").ok, gate(wf, "step1").reason
    change, part = CASES[case]
    change(wf)
    assert main(["gate", str(wf), "step1"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("gate: blocked: step1 changed since its last verification ("), out
    assert part in out, out


def test_a_version_hash_that_could_not_cover_everything_is_refused(
    engine: DockerClient, tmp_path: Path
) -> None:
    wf = _workflow(tmp_path)
    os.mkfifo(wf / "lib" / "pipe")
    _verified(wf)  # even a "passing" verification at exactly this hash
    result = gate(wf, "step1")
    assert not result.ok
    assert result.reason == (
        "step1 not verified: the version hash could not cover "
        "lib/pipe: a fifo (its content cannot be hashed)"
    )


def test_a_verification_run_with_weaker_walls_is_refused(
    engine: DockerClient, tmp_path: Path
) -> None:
    wf = _workflow(tmp_path)
    _verified(
        wf, walls=Walls(seccomp=True, lacking=["no firewall (it was turned off for this run)"])
    )
    result = gate(wf, "step1")
    assert not result.ok
    assert "ran with weaker walls than a normal run (no firewall" in result.reason, result.reason
    _verified(wf, walls=None)  # a history line that does not say: refused too
    assert "its walls are not recorded" in gate(wf, "step1").reason
    _verified(wf)
    assert gate(wf, "step1").ok


def test_an_old_scheme_verification_does_not_match_and_nothing_crashes(
    engine: DockerClient, tmp_path: Path
) -> None:
    wf = _workflow(tmp_path)
    old = ContentHash(digest="0" * 64, parts={"code/[cut]": "more than 20000 entries"})
    _verified(wf, walls=None, content=old)
    result = gate(wf, "step1")
    assert not result.ok and result.reason.startswith("step1 changed since its last verification")
    # The history an older version kept straight in runs/ is not read.
    (wf / "runs" / "verifications.jsonl").write_text(
        json.dumps(
            {
                "run_id": "test-1",
                "step_id": "step1",
                "at": "2025-01-01T00:00:00Z",
                "passed": True,
                "expectations_digest": "",
            }
        )
        + "\n"
    )
    assert history.read(wf) == history.read(wf, "step1") and len(history.read(wf)) == 1


def test_the_history_lives_under_a_test_name_and_is_no_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wf = write_workflow(tmp_path)
    (wf / "runs").mkdir()
    before = sorted(p.relative_to(wf).as_posix() for p in wf.rglob("*"))
    entry = history.HistoryEntry(
        run_id="test-x",
        step_id="step1",
        at=datetime.now(UTC),
        passed=True,
        expectations_digest="",
        walls=FULL,
    )
    history.append_entry(wf, entry)
    after = sorted(p.relative_to(wf).as_posix() for p in wf.rglob("*"))
    assert sorted(set(after) - set(before)) == [
        "runs/test-verifications",
        "runs/test-verifications/verifications.jsonl",
    ]
    assert [e.run_id for e in history.read(wf)] == ["test-x"]
    # Not a run: `sandbox list` shows none, gc --remove-runs keeps it.
    assert main(["list", str(wf)]) == 0
    assert "test-verifications" not in capsys.readouterr().out
    report = collect_host(GcReport(), set(), [wf], remove_runs=True)
    assert report.runs_removed == [] and report.errors == []
    assert [e.run_id for e in history.read(wf)] == ["test-x"]


def test_the_history_folder_is_never_followed_through_a_link(tmp_path: Path) -> None:
    wf = write_workflow(tmp_path)
    (wf / "runs").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (wf / "runs" / "test-verifications").symlink_to(elsewhere)
    entry = history.HistoryEntry(
        run_id="test-x",
        step_id="step1",
        at=datetime.now(UTC),
        passed=True,
        expectations_digest="",
    )
    with pytest.raises(OSError):
        history.append_entry(wf, entry)
    assert list(elsewhere.iterdir()) == []
    assert history.read(wf) == []
