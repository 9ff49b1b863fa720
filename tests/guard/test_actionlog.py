"""The action log: parsable lines, a forwarded call's start before and outcome after,
secrets never written down, sizes capped."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from sandbox.collect.actionsummary import read
from sandbox.contracts.wire import ActionLine
from sandbox.guard import actionlog
from sandbox.guard.actionline import MAX_DEPTH
from sandbox.guard.actionlog import (
    MAX_ITEMS,
    MAX_LINE_BYTES,
    MAX_VALUE_CHARS,
    REDACTED,
    ActionLog,
    LogFull,
    Started,
    redact,
)
from tests.guard.actionlogparts import line_of, write_line


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


@pytest.mark.parametrize("length", [8, 64, 65, 300])
def test_a_credential_key_of_any_length_is_masked(length: int) -> None:
    """A short key's answer is remembered, a long one searched each time: both masked."""
    key = ("x" * length + "_api_key")[-length:] if length >= 7 else "api_key"
    plain = "x" * length
    for _ in range(2):
        assert redact({key: "v", plain: "v"}, ()) == {key: REDACTED, plain: "v"}


def test_lines_are_valid_records_and_summarized(tmp_path: Path) -> None:
    path = tmp_path / "actions.jsonl"
    path.touch()
    log = ActionLog(str(path), secrets=("tok",), durability="per-call")
    asyncio.run(
        write_line(
            log,
            "notify_user",
            reason="messaging",
            category="messaging",
            arguments={"text": "hi tok"},
            duration_ms=0.5,
        )
    )
    asyncio.run(
        write_line(
            log,
            "crew",
            decision="refuse",
            reason="crew calls refused",
            category="crew",
            duration_ms=0.1,
            detail={"fails_step": True},
        )
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


# Every kind of line the guard writes, as `_line` gets its fields (before redaction).
LINE_KINDS: list[dict[str, object]] = [
    {"event": "call", "session": "root", "tool": "notify_user", "decision": "stub",
     "reason": "messaging", "category": "messaging", "arguments": {"text": "hi"},
     "duration_ms": 0.51234, "detail": None},
    {"event": "call", "session": "?", "tool": "/v1/tools/call", "decision": "refuse",
     "reason": "wrong or missing bridge token", "category": "request", "arguments": {},
     "duration_ms": 0.1, "detail": {"fails_step": True}},
    {"event": "start", "call_id": "c1", "session": "s-0123456789ab", "tool": "generate_text_llm",
     "decision": "allow", "reason": "model call", "category": "model",
     "arguments": {"prompt": "é ü 漢字 \u2028", "n": 3, "x": [1, 2.5, None, True, {"y": "z"}]},
     "duration_ms": None, "detail": {"budget_s": 40.0, "request_bytes": 61, "bound": ["run_id"]}},
    {"event": "start", "call_id": "c2", "session": "root", "tool": "write_file",
     "decision": "redirect", "reason": "to the test folder", "category": "fs",
     "arguments": {"path": "a", "content": "c" * (MAX_VALUE_CHARS + 10)},
     "duration_ms": None, "detail": {}},
    {"event": "outcome", "call_id": "c1", "outcome": "ok", "session": "root",
     "tool": "generate_text_llm", "decision": "allow", "reason": "model call",
     "category": "model", "arguments": {}, "duration_ms": 12.3456789,
     "detail": {"upstream_status": 200, "reply_bytes": 1_000_000_000_000}},
    {"event": "outcome", "call_id": "c2", "outcome": "error", "session": "egress",
     "tool": "GET example.com", "decision": "allow", "reason": "r", "category": "egress",
     "arguments": {}, "duration_ms": 0.0, "detail": {"error": "boom\n\"quoted\"\x00"}},
    # From the step: NaN and infinity (the model writes null), a huge line, a long tool.
    {"event": "call", "session": "root", "tool": "t" * 300, "decision": "stub", "reason": "r",
     "category": "c", "arguments": {"a": float("nan"), "b": [float("inf")]},
     "duration_ms": 1.0, "detail": None},
    {"event": "call", "session": "root", "tool": "notify_user", "decision": "stub", "reason": "r",
     "category": "c", "arguments": {f"k{n}": "w" * 1500 for n in range(150)},
     "duration_ms": 1.0, "detail": None},
]  # fmt: skip


@pytest.mark.parametrize("fields", LINE_KINDS)
def test_every_kind_of_line_is_what_the_record_model_writes(
    tmp_path: Path, fields: dict[str, object]
) -> None:
    """The lines are built without a model per line; each is the model's own line: it
    validates as an ActionLine, and it is byte for byte the line the model itself
    writes from the same fields at the same time."""
    log, _ = _log(tmp_path)
    fast = line_of(log, **dict(fields))
    now = ActionLine.model_validate_json(fast).time
    prepared = {**fields, "arguments": redact(fields["arguments"], ("tok",))}
    prepared["detail"] = redact(fields["detail"] or {}, ("tok",))
    prepared["tool"] = str(fields["tool"])[:200]
    prepared["reason"] = redact(str(fields["reason"]), ("tok",))
    if prepared["duration_ms"] is not None:
        prepared["duration_ms"] = round(float(prepared["duration_ms"]), 3)
    model = actionlog._model_line(now, "", prepared)
    if len(model) > MAX_LINE_BYTES:
        prepared["arguments"] = actionlog._summarized(prepared["arguments"])
        prepared["detail"] = actionlog._summarized(prepared["detail"])
        model = actionlog._model_line(now, "", prepared)
    assert fast.endswith(b"\n") and fast.count(b"\n") == 1 and len(fast) <= MAX_LINE_BYTES
    assert ActionLine.model_validate_json(fast) == ActionLine.model_validate_json(model)
    assert fast == model  # NaN and infinity included: null, as the model writes them
    log.close()


def test_a_line_the_model_would_refuse_is_refused(tmp_path: Path) -> None:
    log, path = _log(tmp_path)
    base = dict(LINE_KINDS[0])
    for bad in (
        {"decision": "maybe"},
        {"event": "finish"},
        {"event": "outcome", "outcome": "perhaps"},
        {"event": "start", "call_id": "c" * 41},
        {"session": 5},
    ):
        with pytest.raises(ValidationError):
            line_of(log, **{**base, **bad})
    log.close()
    assert path.read_bytes() == b""


def test_secrets_are_redacted_in_every_field_of_a_line(tmp_path: Path) -> None:
    token = "s3cr3t-run-token-0123456789"
    path = tmp_path / "actions.jsonl"
    path.touch()
    log = ActionLog(str(path), secrets=(token, "exec-token-abcdefghij"), durability="group")

    async def main() -> None:
        await write_line(
            log,
            "notify_user",
            reason=f"reason with {token}",
            category="messaging",
            arguments={"text": f"x{token}y", "password": "hunter2", "deep": [{"api_key": "k"}]},
            duration_ms=1.0,
            detail={"seen": f"exec-token-abcdefghij and {token}", "cookie": "c"},
        )
        started = await log.begin(
            session="root",
            tool="generate_text_llm",
            decision="allow",
            reason="model call",
            category="model",
            arguments={"prompt": token, "Authorization": "Bearer x"},
        )
        await log.outcome(started, ok=False, detail={"error": f"echo {token}"})

    asyncio.run(main())
    log.close()
    raw = path.read_text()
    assert token not in raw and "exec-token-abcdefghij" not in raw and "hunter2" not in raw
    first, start, outcome = [ActionLine.model_validate_json(x) for x in raw.splitlines()]
    assert first.reason == f"reason with {REDACTED}"
    assert first.arguments == {
        "text": f"x{REDACTED}y",
        "password": REDACTED,
        "deep": [{"api_key": REDACTED}],
    }
    assert first.detail == {"seen": f"{REDACTED} and {REDACTED}", "cookie": REDACTED}
    assert start.arguments == {"prompt": REDACTED, "Authorization": REDACTED}
    assert outcome.detail == {"error": f"echo {REDACTED}"}


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
    return ActionLog(str(path), secrets=("tok",), durability="group"), path


def test_a_forwarded_call_has_a_start_line_before_and_an_outcome_after(tmp_path: Path) -> None:
    log, path = _log(tmp_path)
    started = asyncio.run(
        log.begin(
            session="root",
            tool="generate_text_llm",
            decision="allow",
            reason="model call",
            category="model",
            arguments={"prompt": "hi"},
            detail={"budget_s": 40},
        )
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
    asyncio.run(log.outcome(started, ok=False, detail={"error": "boom", "reply_bytes": 3}))
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


def test_a_list_s_items_are_redacted_cut_and_depth_limited_as_an_object_s_are() -> None:
    long = "v" * (MAX_VALUE_CHARS + 1)
    secret = "s3cr3t-run-token"
    items = [f"a {secret}", long, 1, 2.5, None, True, {"token": "t"}, ("tuple", secret)]
    keyed = {str(n): item for n, item in enumerate(items)}
    assert redact(items, (secret,)) == list(redact(keyed, (secret,)).values())
    assert redact(items, (secret,))[0] == f"a {REDACTED}"
    assert redact(items, (secret,))[7] == ["tuple", REDACTED]
    for depth in range(MAX_DEPTH - 1, MAX_DEPTH + 3):  # the same leaf at the same depth
        in_lists: object = secret
        in_objects: object = secret
        for _ in range(depth):
            in_lists, in_objects = [in_lists], {"k": in_objects}
        leaf_of_lists, leaf_of_objects = redact(in_lists, (secret,)), redact(in_objects, (secret,))
        while isinstance(leaf_of_lists, list):
            leaf_of_lists = leaf_of_lists[0]
        while isinstance(leaf_of_objects, dict):
            leaf_of_objects = leaf_of_objects["k"]
        assert leaf_of_lists == leaf_of_objects
        assert leaf_of_lists == (REDACTED if depth <= MAX_DEPTH else "[too deep]")


def test_long_values_are_cut_and_hashed_and_huge_lines_summarized(tmp_path: Path) -> None:
    value = "v" * (MAX_VALUE_CHARS + 500)
    cut = redact({"text": value})["text"]
    assert cut.startswith("v" * MAX_VALUE_CHARS)
    assert f"500 chars cut; sha256 {hashlib.sha256(value.encode()).hexdigest()}" in cut
    assert len(redact(list(range(1000)))) == MAX_ITEMS + 1
    log, path = _log(tmp_path)
    wide = {f"k{n}": "w" * 1500 for n in range(150)}  # each value fits; the line does not
    asyncio.run(
        write_line(
            log,
            "notify_user",
            reason="messaging",
            category="messaging",
            arguments=wide,
            duration_ms=0.1,
        )
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
    arguments = {"p": "x" * 300}
    common = {"session": "root", "category": "model", "arguments": arguments}

    async def calls() -> Started:
        before = await log.begin(tool="a", decision="allow", reason="r", **common)  # type: ignore[arg-type]
        for _ in range(10):
            await write_line(log, "n", category="model", arguments=arguments, duration_ms=0.1)
        with pytest.raises(LogFull):
            await log.begin(tool="b", decision="allow", reason="r", **common)  # type: ignore[arg-type]
        await log.outcome(before, ok=True)  # a call already started still gets its outcome
        return before

    before = asyncio.run(calls())
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
