"""The guard's bridge against real upstream servers on loopback (in-process guard).

The upstreams are stand-ins for the real bridge (the outside world): real TCP
servers that record every request they receive, byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandbox.contracts.wire import ActionLine, ToolReply, ToolResult
from sandbox.guard.actionlog import ActionLog
from sandbox.guard.app import build_app
from sandbox.guard.bridge.routes import Guard
from sandbox.guard.bridge.upstream import Reply
from sandbox.guard.limits import MAX_UPSTREAM_REPLY_BYTES
from tests.conftest import call_lines, guard_config
from tests.guard.actionlogparts import write_line
from tests.guard.bridge.bridgeparts import AUTH, TOKEN, Upstream, make_guard, ok, oversized_reply


@pytest.fixture
def guard_at(tmp_path: Path) -> Iterator[Callable[[str | None], tuple[Guard, Path]]]:
    made: list[Guard] = []

    def make(upstream: str | None) -> tuple[Guard, Path]:
        guard, actions = make_guard(tmp_path, f"actions-{len(made)}", upstream)
        made.append(guard)
        return guard, actions

    yield make


def call_all(guard: Guard, calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        transport = httpx.ASGITransport(app=build_app(guard))
        async with httpx.AsyncClient(transport=transport, base_url="http://guard") as client:
            replies = []
            for tool, arguments in calls:
                r = await client.post(
                    "/v1/tools/call", json={"tool": tool, "arguments": arguments}, headers=AUTH
                )
                replies.append(r.json())
        await guard.close()
        return replies

    return asyncio.run(main())


def lines_of(actions: Path) -> list[ActionLine]:
    """One line a call; a forwarded call's outcome (checked to follow its start) merged in."""
    return call_lines(actions)


def test_a_call_whose_bytes_were_written_is_never_sent_again(
    guard_at: Callable[[str | None], tuple[Guard, Path]],
) -> None:
    """The second call goes out on the kept-alive connection; the upstream reads it and
    the connection dies before any reply. The call may have run: it must not run twice."""
    upstream = Upstream(lambda n, body: ok() if n == 1 else None)
    try:
        guard, actions = guard_at(upstream.url)
        replies = call_all(
            guard, [("web_fetch", {"url": "https://a/1"}), ("web_fetch", {"url": "https://a/2"})]
        )
    finally:
        upstream.close()
    assert [json.loads(b)["arguments"]["url"] for b in upstream.requests] == [
        "https://a/1",
        "https://a/2",
    ]  # each call reached the upstream exactly once
    assert replies[0]["ok"] is True and replies[0]["result"]["text"] == "done"
    assert replies[1]["ok"] is False
    assert "not repeated" in replies[1]["result"]["text"]
    assert "TEST MODE" not in replies[1]["result"]["text"]
    assert [ln.decision for ln in lines_of(actions)] == ["allow", "allow"]
    assert lines_of(actions)[1].detail["error"].startswith("upstream bridge failed")


@pytest.mark.parametrize("framing", ["declared", "chunked"])
def test_an_upstream_reply_past_its_cap_is_a_tool_error_and_the_guard_goes_on(
    guard_at: Callable[[str | None], tuple[Guard, Path]], framing: str
) -> None:
    """A reply larger than limits.MAX_UPSTREAM_REPLY_BYTES (declared up front, or chunked
    with no length) is dropped: the step gets an error naming the cap, the call's outcome
    line says so, it is not sent again, and the next call is answered."""
    big = oversized_reply(framing)
    upstream = Upstream(lambda n, body: big if b"/big" in body else ok())
    try:
        guard, actions = guard_at(upstream.url)
        replies = call_all(
            guard, [("web_fetch", {"url": "https://a/big"}), ("web_fetch", {"url": "https://a/2"})]
        )
    finally:
        upstream.close()
    assert len(upstream.requests) == 2  # the big one once, then the next call
    assert replies[0]["ok"] is False
    assert "larger than 8 MiB (the guard's cap)" in replies[0]["result"]["text"]
    assert replies[1]["ok"] is True and replies[1]["result"]["text"] == "done"
    first, second = lines_of(actions)
    assert (
        first.decision == "allow"
        and first.detail["reply_bytes"] == f"more than {MAX_UPSTREAM_REPLY_BYTES}"
    )
    assert "the guard's cap" in first.detail["error"]
    assert second.detail["upstream_status"] == 200


def test_with_the_action_log_full_a_call_is_stubbed_not_forwarded_and_counted_once(
    guard_at: Callable[[str | None], tuple[Guard, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandbox.collect.actionsummary import read
    from sandbox.guard import actionlog

    monkeypatch.setattr(actionlog, "MAX_LOG_BYTES", 1200)
    upstream = Upstream(lambda n, body: ok())
    try:
        guard, actions = guard_at(upstream.url)
        while not guard.log.full:
            asyncio.run(write_line(guard.log, "filler", reason="fill", arguments={"x": "x" * 200}))
        replies = call_all(guard, [("web_fetch", {"url": "https://a/1"})])
        guard.log.close()
    finally:
        upstream.close()
    assert upstream.requests == []
    assert replies[0]["decision"] == "stub"
    assert "action log reached its cap" in replies[0]["result"]["text"]
    # The filler that found the log full, and the call: each counted once.
    assert read(actions).counts.stubbed_unlogged == 2


def test_a_kept_alive_connection_the_upstream_closed_is_replaced_before_sending(
    guard_at: Callable[[str | None], tuple[Guard, Path]],
) -> None:
    """An upstream that closes after each reply without saying so: every call still
    arrives once and succeeds (the closed connection is noticed before reuse)."""
    upstream = Upstream(lambda n, body: ok(), close_after_reply=True)
    try:
        guard, _ = guard_at(upstream.url)

        async def main() -> list[dict[str, Any]]:
            transport = httpx.ASGITransport(app=build_app(guard))
            async with httpx.AsyncClient(transport=transport, base_url="http://g") as client:
                replies = []
                for i in range(20):
                    r = await client.post(
                        "/v1/tools/call",
                        json={"tool": "web_fetch", "arguments": {"url": f"https://a/{i}"}},
                        headers=AUTH,
                    )
                    replies.append(r.json())
                    # The upstream has closed this connection before the next call.
                    deadline = asyncio.get_running_loop().time() + 10
                    while upstream.closed <= i:
                        assert asyncio.get_running_loop().time() < deadline
                        await asyncio.sleep(0.001)
            await guard.close()
            return replies

        replies = asyncio.run(main())
    finally:
        upstream.close()
    assert [r["ok"] for r in replies] == [True] * 20
    assert len(upstream.requests) == 20


def test_identity_is_bound_per_tool_and_everything_else_passes_untouched(
    guard_at: Callable[[str | None], tuple[Guard, Path]],
) -> None:
    upstream = Upstream(lambda n, body: ok())
    forged_llm = {
        "prompt": "hi",
        "session": "forged-session",
        "metadata": {"run_id": "forged-run", "run_kind": "real", "tag": "mine"},
        "options": {"run_id": "nested-not-bound"},
        "run_id": "top-level-not-bound-here",
    }
    status = {"run_id": "run-2024-17", "step_id": "bid-submit", "detail": {"session": "x"}}
    browser = {"command": "snapshot", "session": {"forged": True}}
    try:
        guard, actions = guard_at(upstream.url)
        replies = call_all(
            guard,
            [
                ("generate_text_llm", forged_llm),
                ("get_run_status", status),
                ("agent_browser", browser),
                ("generate_text_llm", {"prompt": "plain", "metadata": "not an object"}),
            ],
        )
    finally:
        upstream.close()
    assert [r["decision"] for r in replies] == ["allow"] * 4
    sent = [json.loads(b) for b in upstream.requests]
    for call in sent:  # the envelope is always the guard's
        assert (call["run_id"], call["session"], call["workflow"], call["step"]) == (
            "test-x",
            "root",
            "wf",
            "s",
        )
        assert call["run_kind"] == "test"
    assert sent[0]["arguments"] == {
        "prompt": "hi",
        "session": "root",
        "metadata": {"run_id": "test-x", "run_kind": "test", "tag": "mine"},
        "options": {"run_id": "nested-not-bound"},
        "run_id": "top-level-not-bound-here",
    }
    assert sent[1]["arguments"] == status  # a read tool's real run_id and step_id
    assert sent[2]["arguments"] == {"command": "snapshot", "session": "root"}
    assert sent[3]["arguments"] == {
        "prompt": "plain",
        "session": "root",
        "metadata": {"run_id": "test-x", "run_kind": "test"},
    }
    lines = lines_of(actions)
    assert lines[0].detail["overwrote"] == ["session", "metadata.run_id", "metadata.run_kind"]
    assert "forged" not in json.dumps(lines[0].arguments)
    assert lines[1].arguments == status and "bound" not in lines[1].detail


def test_stubbed_calls_are_logged_without_the_bound_paths(
    guard_at: Callable[[str | None], tuple[Guard, Path]],
) -> None:
    guard, actions = guard_at(None)
    replies = call_all(guard, [("agent_browser", {"command": "click #x", "session": "forged"})])
    assert replies[0]["decision"] == "stub"
    (line,) = lines_of(actions)
    assert line.arguments == {"command": "click #x"}


@pytest.mark.parametrize("asked", [300, "300", " 300 ", 450.5, "1e9", None, 0, "abc", True])
def test_the_guard_waits_as_long_as_the_executor_may_run_the_command(
    guard_at: Callable[[str | None], tuple[Guard, Path]], asked: object
) -> None:
    """The guard's wait for a shell command comes from the executor's own timeout rule."""
    from sandbox.stepside.agentworks_exec.toolargs import SHELL_KILL_GRACE_S, shell_timeout_s

    guard, _ = guard_at(None)
    seen: list[float] = []

    async def record(body: bytes, timeout: float) -> Reply:
        seen.append(timeout)
        return Reply(200, b'{"text": "ran"}')

    guard.executor._post = record  # type: ignore[method-assign]
    arguments = {"command": "sleep 1"} if asked is None else {"command": "x", "timeout_s": asked}
    asyncio.run(guard.executor.run("execute_shell_command", arguments, {}))
    try:
        executor_s = shell_timeout_s(asked)
    except ValueError:
        executor_s = 0.0  # refused by the executor at once
    (waited,) = seen
    assert waited >= executor_s + SHELL_KILL_GRACE_S + guard.config.grace_s


class _Disk:
    """`fdatasync` that notes how many bytes of the file each finished sync covered
    (and takes `seconds`, as a slow shared disk does)."""

    def __init__(self, path: Path, seconds: float = 0.0) -> None:
        self.path = path
        self.seconds = seconds
        self.synced_bytes = 0
        self._real = os.fdatasync

    def __call__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        threading.Event().wait(self.seconds)
        self._real(fd)
        self.synced_bytes = size


def _synced_guard(
    tmp_path: Path, upstream: str, monkeypatch: pytest.MonkeyPatch, seconds: float = 0.0
) -> tuple[Guard, Path, _Disk]:
    """A guard in this process whose log syncs each round, on a disk that says what its
    syncs covered."""
    actions = tmp_path / "synced.jsonl"
    actions.touch()
    disk = _Disk(actions, seconds)
    monkeypatch.setattr(os, "fdatasync", disk)
    config = guard_config(actions, upstream=upstream)
    log = ActionLog(str(actions), secrets=(TOKEN,), durability="per-call")
    return Guard(config, log), actions, disk


def test_a_forwarded_call_costs_one_sync_its_start_written_before_it_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start line is in the file when the upstream reads the call (a guard killed
    then leaves "started, outcome unknown") but was not synced for it; the reply comes
    only after the one sync that covers the call's start and outcome lines."""
    at_upstream: list[tuple[list[ActionLine], int]] = []
    box: list[Guard] = []

    def answer(n: int, body: bytes) -> bytes:
        lines = (tmp_path / "synced.jsonl").read_text().splitlines()
        at_upstream.append(([ActionLine.model_validate_json(x) for x in lines], box[0].log.syncs))
        return ok(f"r{n}")

    upstream = Upstream(answer)
    try:
        guard, actions, disk = _synced_guard(tmp_path, upstream.url, monkeypatch)
        box.append(guard)

        async def main() -> list[tuple[int, int, int]]:
            transport = httpx.ASGITransport(app=build_app(guard))
            seen = []
            async with httpx.AsyncClient(transport=transport, base_url="http://guard") as client:
                for n in range(3):
                    r = await client.post(
                        "/v1/tools/call",
                        json={"tool": "web_fetch", "arguments": {"url": f"https://a/{n}"}},
                        headers=AUTH,
                    )
                    assert r.json()["result"]["text"] == f"r{n + 1}"
                    # when the reply arrived: syncs so far, bytes synced, bytes written
                    seen.append((guard.log.syncs, disk.synced_bytes, actions.stat().st_size))
            await guard.close()
            return seen

        at_reply = asyncio.run(main())
    finally:
        upstream.close()
    for n, (lines, syncs) in enumerate(at_upstream):
        # every earlier call complete, this call's start line last, no sync for it yet
        assert [(ln.event, ln.call_id) for ln in lines][-1] == ("start", f"c{n + 1}")
        assert lines[-1].arguments["url"] == f"https://a/{n}"
        assert syncs == n
    # one sync per call, and each reply after the sync that covered all its lines
    assert [(syncs, synced == written) for syncs, synced, written in at_reply] == [
        (1, True),
        (2, True),
        (3, True),
    ]
    assert [ln.detail["upstream_status"] for ln in lines_of(actions)] == [200, 200, 200]


def test_concurrent_forwarded_calls_share_syncs_and_no_reply_precedes_its_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N calls at once through the bridge on a slow disk: every call's two lines in
    order, fewer syncs than calls, and each reply only once its lines are synced."""
    upstream = Upstream(lambda n, body: ok(json.loads(body)["arguments"]["url"]))
    calls = 12
    try:
        guard, actions, disk = _synced_guard(tmp_path, upstream.url, monkeypatch, 0.01)

        async def main() -> list[bool]:
            transport = httpx.ASGITransport(app=build_app(guard))
            async with httpx.AsyncClient(transport=transport, base_url="http://guard") as client:

                async def one(n: int) -> bool:
                    url = f"https://a/{n}"
                    r = await client.post(
                        "/v1/tools/call",
                        json={"tool": "web_fetch", "arguments": {"url": url}},
                        headers=AUTH,
                    )
                    assert r.json()["result"]["text"] == url
                    raw = actions.read_bytes()
                    mine = [
                        i
                        for i, ln in enumerate(raw.split(b"\n"))
                        if f'"url":"{url}"'.encode() in ln
                    ]
                    (start_at,) = mine  # the outcome names the call by its id
                    start = ActionLine.model_validate_json(raw.split(b"\n")[start_at])
                    end = raw.index(f'"call_id":"{start.call_id}","outcome"'.encode())
                    return disk.synced_bytes >= raw.index(b"\n", end) + 1

                covered = await asyncio.gather(*(one(n) for n in range(calls)))
            await guard.close()
            return list(covered)

        covered = asyncio.run(main())
    finally:
        upstream.close()
    assert covered == [True] * calls
    assert 1 <= guard.log.syncs < calls
    assert sorted(ln.arguments["url"] for ln in lines_of(actions)) == sorted(
        f"https://a/{n}" for n in range(calls)
    )


def test_forwarded_calls_with_the_same_answer_copy_it_once(
    guard_at: Callable[[str | None], tuple[Guard, Path]], opened_paths: list[str]
) -> None:
    """Each forwarded call has its start and outcome lines and its index line; an answer
    the recording holds already opens no file again (one copy of it, no file written and
    removed per call)."""
    upstream = Upstream(lambda n, body: ok("the same answer"))
    guard, actions = guard_at(upstream.url)
    try:
        replies = call_all(guard, [("generate_text_llm", {"prompt": f"p{n}"}) for n in range(6)])
    finally:
        upstream.close()
    assert [r["result"]["text"] for r in replies] == ["the same answer"] * 6
    assert len(upstream.requests) == 6
    raw = [ActionLine.model_validate_json(line) for line in actions.read_text().splitlines()]
    assert [line.event for line in raw] == ["start", "outcome"] * 6
    blobs = actions.parent / "recording" / "blobs"
    assert [path for path in opened_paths if os.path.dirname(path) == str(blobs)] == [
        str(blobs / ".part-1")
    ]
    index = (actions.parent / "recording" / "index.jsonl").read_text().splitlines()
    assert len(index) == 6 and all(json.loads(line)["kept"] for line in index)


def test_calls_in_flight_are_named_for_the_egress_lines(
    guard_at: Callable[[str | None], tuple[Guard, Path]],
) -> None:
    release = threading.Event()
    upstream = Upstream(lambda n, body: ok() if release.wait(30) else None)
    guard, _ = guard_at(upstream.url)

    async def main() -> tuple[list[str], list[str], list[dict[str, Any]]]:
        transport = httpx.ASGITransport(app=build_app(guard))
        async with httpx.AsyncClient(transport=transport, base_url="http://guard") as client:
            child = (await client.post("/v1/sessions", json={}, headers=AUTH)).json()["session"]
            calls = [
                asyncio.ensure_future(
                    client.post(
                        "/v1/tools/call",
                        json={"tool": "web_fetch", "arguments": {"url": "https://a"}, **session},
                        headers=AUTH,
                    )
                )
                for session in ({}, {"session": child}, {"session": child})
            ]
            deadline = time.monotonic() + 30
            while len(guard._inflight) < 3:  # all three wait on the upstream
                assert time.monotonic() < deadline, guard.active_calls()
                await asyncio.sleep(0.01)
            named = guard.active_calls()
            release.set()
            replies = [(await call).json() for call in calls]
            after = guard.active_calls()
        await guard.close()
        return named, after, replies

    try:
        named, after, replies = asyncio.run(main())
    finally:
        release.set()
        upstream.close()
    assert [r["ok"] for r in replies] == [True] * 3
    child = replies[1]["session"]
    # one name per tool and session, in order
    assert named == sorted([f"web_fetch (session {child})", "web_fetch (session root)"])
    assert after == []


def test_a_forwarded_reply_is_the_reply_model_s_json_of_the_upstream_s_answer(
    guard_at: Callable[[str | None], tuple[Guard, Path]],
) -> None:
    """The step's reply bytes, byte for byte the reply model's JSON of the answer the
    upstream gave (its result as its model reads it), when the recording encoded that
    result first and when it is asked again."""
    answer = {
        "text": 'ünïcode ✓ \u2028 "q"',
        "data": {"f": [1e16, 0.1, -0.0], "big": 2**70, "n": None},
        "extra": 1,
    }
    payload = json.dumps(answer, ensure_ascii=False).encode()
    upstream = Upstream(
        lambda n, body: b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    guard, _ = guard_at(upstream.url)

    async def main() -> list[bytes]:
        transport = httpx.ASGITransport(app=build_app(guard))
        async with httpx.AsyncClient(transport=transport, base_url="http://guard") as client:
            body = {"tool": "generate_text_llm", "arguments": {"prompt": "p"}}
            replies = [
                (await client.post("/v1/tools/call", json=body, headers=AUTH)).content
                for _ in range(2)
            ]
        await guard.close()
        return replies

    try:
        replies = asyncio.run(main())
    finally:
        upstream.close()
    result = ToolResult.model_validate_json(payload)
    for reply in replies:
        fields = {**json.loads(reply), "result": result}
        assert reply == ToolReply.model_validate(fields).model_dump_json().encode()
    assert json.loads(replies[0])["decision"] == "allow"


def test_a_call_past_its_budget_is_abandoned_with_its_refusal_and_its_line(
    tmp_path: Path,
) -> None:
    """An upstream that never answers: at the tool's budget the step gets the budget's
    error and the outcome line says it timed out; the hung connection is not used
    again, and the calls after it (within their budget) are answered."""
    release = threading.Event()

    def answer(n: int, body: bytes) -> bytes | None:
        if b"/slow" in body:
            release.wait(60)
            return None
        return ok()

    upstream = Upstream(answer)
    actions = tmp_path / "actions.jsonl"
    actions.touch()
    config = guard_config(actions, upstream=upstream.url, budgets={"web_fetch": 0.2}, grace_s=0)
    guard = Guard(config, ActionLog(str(actions), secrets=(TOKEN,), durability="group"))
    calls = [("web_fetch", {"url": f"https://a/{u}"}) for u in ("1", "slow", "2", "3")]
    try:
        replies = call_all(guard, calls)
    finally:
        release.set()
        upstream.close()
    assert [r["ok"] for r in replies] == [True, False, True, True]
    assert replies[1]["result"] == {
        "text": "web_fetch exceeded its time budget of 0.2 s and was abandoned",
        "is_error": True,
        "data": None,
    }
    lines = lines_of(actions)
    assert [ln.decision for ln in lines] == ["allow"] * 4
    assert lines[1].detail.get("timed_out") is True
    assert [ln.detail.get("timed_out") for ln in (lines[0], lines[2], lines[3])] == [None] * 3
    assert upstream.connections == 2  # the hung one was closed, not reused
