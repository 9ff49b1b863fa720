"""The body the guard sends the real bridge is the `UpstreamCall` model's, byte for
byte; a forwarder's calls keep their budgets without a loop timer each."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sandbox.contracts.wire import ToolCall, UpstreamCall
from sandbox.guard.bridge.forward import UpstreamForward, upstream_body
from sandbox.guard.limits import FORWARD_SLOTS, ForwardSlots
from tests.conftest import guard_config
from tests.guard.bridge.bridgeparts import TimerCountingLoop, Upstream, ok

CALLS = [
    rb'{"tool": "generate_text_llm", "arguments": {"prompt": "bench"}}',
    rb'{"tool": "t", "arguments": {}}',
    # what the step may send: NaN and infinity, non-ASCII and escapes, deep and big values
    rb'{"tool": "t\u00e9", "arguments": {"x": NaN, "y": 1e400, "z": "\u00e9\ud83d\ude00 \"q\"\n",'
    rb' "w": [1, 2.5, null, true, {"a": {}}], "big": 123456789012345678901234567890,'
    rb' "metadata": {"run_id": "forged", "n": -0.0}}}',
]


@pytest.mark.parametrize("raw", CALLS)
def test_the_upstream_body_is_the_models_json(raw: bytes) -> None:
    call = ToolCall.model_validate_json(raw)
    fields: dict[str, Any] = {
        "tool": call.tool,
        "arguments": call.arguments,
        "run_id": "test-x",
        "session": "s-\u00e9",
        "workflow": "wf",
        "step": "s",
    }
    assert upstream_body(**fields) == UpstreamCall(**fields).model_dump_json().encode()


def test_forwarded_calls_that_end_in_time_arm_one_loop_timer(tmp_path: Path) -> None:
    """Every forwarded call has its budget, and a timer armed and cancelled per call was
    a large part of its cost: the calls of one forwarder share one timer, armed for
    the earliest deadline."""
    upstream = Upstream(lambda n, body: ok())
    actions = tmp_path / "actions.jsonl"
    actions.touch()
    forward = UpstreamForward(
        guard_config(actions, upstream=upstream.url), ForwardSlots(FORWARD_SLOTS)
    )

    async def main() -> list[str]:
        texts = []
        for i in range(20):
            result = await forward.call("web_fetch", {"url": f"https://a/{i}"}, "root", {})
            texts.append(result.text)
        await forward.aclose()
        return texts

    TimerCountingLoop.timers = 0
    try:
        with asyncio.Runner(loop_factory=TimerCountingLoop) as runner:
            assert runner.run(main()) == ["done"] * 20
    finally:
        upstream.close()
    assert len(upstream.requests) == 20
    assert TimerCountingLoop.timers == 1
