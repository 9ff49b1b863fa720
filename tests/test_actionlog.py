"""The action log: one parsable line per call, secrets never written down."""

from __future__ import annotations

from pathlib import Path

from sandbox.actionsummary import read
from sandbox.guard.actionlog import REDACTED, ActionLog, redact
from sandbox.wire import ActionLine


def test_redact_masks_credential_keys_and_known_secrets() -> None:
    args = {
        "text": "token is s3cr3t-run-token here",
        "api_key": "abc",
        "nested": {"Authorization": "Bearer x", "password": "p", "ok": [1, "s3cr3t-run-token"]},
        "n": 3,
    }
    out = redact(args, ("s3cr3t-run-token",))
    assert out == {
        "text": f"token is {REDACTED} here",
        "api_key": REDACTED,
        "nested": {"Authorization": REDACTED, "password": REDACTED, "ok": [1, REDACTED]},
        "n": 3,
    }


def test_lines_are_valid_records_and_summarized(tmp_path: Path) -> None:
    path = tmp_path / "actions.jsonl"
    path.touch()
    log = ActionLog(str(path), secrets=("tok",), fsync_each=True)
    log.write(
        session="root",
        tool="notify_user",
        decision="stub",
        reason="messaging",
        category="messaging",
        arguments={"text": "hi tok"},
        duration_ms=0.5,
    )
    log.write(
        session="root",
        tool="crew",
        decision="refuse",
        reason="crew calls refused",
        category="crew",
        arguments={},
        duration_ms=0.1,
        detail={"fails_step": True},
    )
    log.close()
    lines = [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]
    assert [ln.tool for ln in lines] == ["notify_user", "crew"]
    assert lines[0].arguments == {"text": f"hi {REDACTED}"}
    with path.open("a") as handle:
        handle.write("not json\n")
    summary = read(path)
    assert [s.tool for s in summary.stubbed] == ["notify_user"]
    assert summary.stubbed[0].detail == 'text="hi [redacted]"'
    assert (summary.counts.stub, summary.counts.refuse, summary.counts.malformed) == (1, 1, 1)
    assert summary.fails_step.startswith("crew was refused in test mode")


def test_summary_never_follows_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.jsonl"
    target.write_text('{"bogus": true}\n')
    link = tmp_path / "actions.jsonl"
    link.symlink_to(target)
    summary = read(link)
    assert summary.stubbed == [] and summary.counts.malformed == 0
