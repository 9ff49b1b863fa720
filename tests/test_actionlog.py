"""The action log: parsable lines, a forwarded call's start before and outcome after,
secrets never written down, sizes capped."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sandbox.collect.actionsummary import read
from sandbox.contracts.wire import ActionLine
from sandbox.guard import actionlog
from sandbox.guard.actionlog import (
    MAX_ITEMS,
    MAX_LINE_BYTES,
    MAX_VALUE_CHARS,
    REDACTED,
    ActionLog,
    LogFull,
    redact,
)


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


def _log(tmp_path: Path) -> tuple[ActionLog, Path]:
    path = tmp_path / "actions.jsonl"
    path.touch()
    return ActionLog(str(path), secrets=("tok",), fsync_each=False), path


def test_a_forwarded_call_has_a_start_line_before_and_an_outcome_after(tmp_path: Path) -> None:
    log, path = _log(tmp_path)
    started = log.begin(
        session="root",
        tool="generate_text_llm",
        decision="allow",
        reason="model call",
        category="model",
        arguments={"prompt": "hi"},
        detail={"budget_s": 40},
    )
    (line,) = [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]
    assert (line.event, line.call_id, line.arguments) == (
        "start",
        started.call_id,
        {"prompt": "hi"},
    )
    # A guard that died here: the record says started, outcome unknown.
    summary = read(path)
    assert summary.counts.allow == 1 and summary.counts.outcome_unknown == 1
    (unknown,) = summary.outcome_unknown
    assert (unknown.tool, unknown.call_id) == ("generate_text_llm", started.call_id)
    log.outcome(started, ok=False, detail={"error": "boom", "reply_bytes": 3})
    log.close()
    start, outcome = [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]
    assert (outcome.event, outcome.call_id, outcome.outcome) == ("outcome", start.call_id, "error")
    assert outcome.duration_ms is not None and outcome.detail["reply_bytes"] == 3
    summary = read(path)
    assert (summary.counts.allow, summary.counts.outcome_unknown) == (1, 0)
    assert summary.counts.outcome_error == 1 and summary.outcome_unknown == []


def test_an_outcome_of_no_started_call_is_not_trusted(tmp_path: Path) -> None:
    path = tmp_path / "actions.jsonl"
    line = {"time": "2026-01-01T00:00:00Z", "session": "root", "tool": "t", "decision": "allow"}
    path.write_text(json.dumps({**line, "reason": "", "event": "outcome", "call_id": "c9"}) + "\n")
    summary = read(path)
    assert summary.counts.malformed == 1 and summary.counts.allow == 0


def test_long_values_are_cut_and_hashed_and_huge_lines_summarized(tmp_path: Path) -> None:
    value = "v" * (MAX_VALUE_CHARS + 500)
    cut = redact({"text": value})["text"]
    assert cut.startswith("v" * MAX_VALUE_CHARS)
    assert f"500 chars cut; sha256 {hashlib.sha256(value.encode()).hexdigest()}" in cut
    assert len(redact(list(range(1000)))) == MAX_ITEMS + 1
    log, path = _log(tmp_path)
    wide = {f"k{n}": "w" * 1500 for n in range(150)}  # each value fits; the line does not
    log.write(
        session="root",
        tool="notify_user",
        decision="stub",
        reason="messaging",
        category="messaging",
        arguments=wide,
        duration_ms=0.1,
    )
    raw = path.read_bytes()
    assert len(raw) < MAX_LINE_BYTES
    line = ActionLine.model_validate_json(raw)
    assert list(line.arguments) == ["[cut]"] and "sha256" in line.arguments["[cut]"]


def test_a_full_log_marks_itself_and_later_calls_are_stubbed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actionlog, "MAX_LOG_BYTES", 2000)
    log, path = _log(tmp_path)
    common = {"session": "root", "category": "model", "arguments": {"p": "x" * 300}}
    before = log.begin(tool="a", decision="allow", reason="r", **common)  # type: ignore[arg-type]
    for _ in range(10):
        log.write(tool="n", decision="stub", reason="r", duration_ms=0.1, **common)  # type: ignore[arg-type]
    with pytest.raises(LogFull):
        log.begin(tool="b", decision="allow", reason="r", **common)  # type: ignore[arg-type]
    log.outcome(before, ok=True)  # a call already started still gets its outcome
    log.close()
    lines = [ActionLine.model_validate_json(x) for x in path.read_text().splitlines()]
    markers = [ln for ln in lines if ln.event == "log_full"]
    assert len(markers) == 2 and markers[-1].detail["stubbed_unlogged"] >= 2
    assert lines[-2].event == "outcome" and lines[-2].call_id == before.call_id
    assert "b" not in [ln.tool for ln in lines]
    summary = read(path)
    assert (
        summary.counts.log_full
        and summary.counts.stubbed_unlogged == markers[-1].detail["stubbed_unlogged"]
    )
    assert summary.counts.outcome_unknown == 0
