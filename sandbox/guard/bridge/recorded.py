"""Forwarded bridge calls (model calls too) recorded, and answered from a replay.

The key is the tool and the step's own arguments (the identity paths the guard
binds are left out: they name the run). A result the upstream answered (200) is
kept as its JSON; a replay hit returns it without contacting the upstream; a miss
returns a `TEST MODE` replay-miss error result, or goes out with misses live. The
call's start line is written before any of this (`routes`), its outcome says which.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sandbox.contracts.recording import bridge_key_of, miss_text
from sandbox.contracts.wire import ToolResult, json_of
from sandbox.guard.bridge import bindings
from sandbox.guard.bridge.forward import UpstreamForward
from sandbox.guard.recording import Reads, Tap


def bridge_key(tool: str, arguments: dict[str, Any]) -> str:
    """The key of a call with these (bound or unbound) arguments."""
    return own_key(tool, bindings.without_bound(tool, arguments))


def own_key(tool: str, own: dict[str, Any]) -> str:
    """The key of a call whose bound paths are already left out (`without_bound`):
    the bridge has them for its verdict, so they are not made again per call."""
    return bridge_key_of(tool, own)


class RecordedForward:
    """`UpstreamForward` with its answers recorded, and served from a replay."""

    def __init__(self, inner: UpstreamForward, reads: Reads) -> None:
        self._inner, self._reads = inner, reads

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def call(
        self,
        tool: str,
        arguments: dict[str, Any],
        session: str,
        detail: dict[str, Any],
        own: dict[str, Any] | None = None,
    ) -> tuple[ToolResult, bytes | None]:
        """The result, and its JSON (`json_of`) when it was made for the recording.
        `own`: `without_bound(tool, arguments)`, when the caller has it already."""
        key = own_key(tool, own) if own is not None else bridge_key(tool, arguments)
        what = f"bridge {tool}"
        recorder, replay = self._reads.recorder, self._reads.replay
        mark = ""
        if replay is not None:
            data = replay.answer(key)
            result = _parsed(data) if data is not None else None
            if result is not None:
                detail.update(replay="hit", replay_key=key)
                _keep(recorder.tap(key, "bridge", what, replay="hit"), data or b"")
                return result, None  # the recorded bytes, not necessarily `json_of`'s
            recorder.note_miss(key, "bridge", what)
            detail.update(replay="miss", replay_key=key)
            if replay.miss_mode != "live":
                return ToolResult(text=miss_text(what), is_error=True), None
            detail["replay"], mark = "live", "live"
        result = await self._inner.call(tool, arguments, session, detail)
        if detail.get("upstream_status") != 200:
            return result, None
        encoded = json_of(result)
        _keep(recorder.tap(key, "bridge", what, replay=mark), encoded)
        return result, encoded


def _keep(tap: Tap, data: bytes) -> None:
    tap.whole(data)


def _parsed(data: bytes) -> ToolResult | None:
    try:
        return ToolResult.model_validate_json(data)
    except ValidationError:
        return None
