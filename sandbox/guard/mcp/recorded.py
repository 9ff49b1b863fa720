"""An allowed MCP call's result recorded, and answered from a replay.

The key is the server, the tool and the arguments (`key_of("mcp", ...)`). A result
the server answered (no protocol error) is kept as its wire JSON. In a replay the
tool list is still asked live (the policy judges the server's annotations as they
are now); a hit is the recorded result without the call reaching the server; a miss
is a `TEST MODE` replay-miss error result, or goes out with misses live.

A result is kept after the call: its JSON is made on the loop's next turn (the hot
path has written the reply by then) and the recorder's thread hashes it and writes
its blob and index line (`Recorder.keep_later`), so no disk operation of the
recording is on the call's path. The key is made only when it is needed (a replay,
a result kept). A guard killed in between loses that copy (the action log has the
call; a replay of it is a miss).
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from sandbox.contracts.recording import key_of, miss_text
from sandbox.guard.recording import Reads


class Recorded:
    """One allowed call's key, and its result's way in and out of the recording."""

    def __init__(self, reads: Reads | None, server: str, tool: str, arguments: dict[str, Any]):
        self._reads = reads
        self._server, self._tool, self._arguments = server, tool, arguments
        self.what = f"mcp {server}/{tool}"
        self._mark = ""

    @functools.cached_property
    def key(self) -> str:
        return key_of("mcp", server=self._server, tool=self._tool, arguments=self._arguments)

    def replayed(self, outcome: dict[str, Any]) -> dict[str, Any] | None:
        """The result to answer with instead of calling the server (None: call it)."""
        reads = self._reads
        if reads is None or reads.replay is None:
            return None
        data = reads.replay.answer(self.key)
        if data is not None:
            try:
                result = json.loads(data)
            except ValueError:
                result = None
            if isinstance(result, dict):
                outcome.update(replay="hit", replay_key=self.key)
                self._keep(data, "hit")
                return result
        reads.recorder.note_miss(self.key, "mcp", self.what)
        outcome.update(replay="miss", replay_key=self.key)
        if reads.replay.miss_mode == "live":
            outcome["replay"] = self._mark = "live"
            return None
        return {
            "content": [{"type": "text", "text": miss_text(self.what)}],
            "isError": True,
            "resultType": "complete",
        }

    def keep(self, result: dict[str, Any], outcome: dict[str, Any]) -> None:
        """A result the server answered, kept (not a guard-made error) after the call:
        on the loop's next turn (the hot path writes the reply in the turn the call
        ends), then on the recorder's thread."""
        if self._reads is None or "error" in outcome:
            return
        asyncio.get_running_loop().call_soon(self._after_reply, result, self._mark)

    def _after_reply(self, result: dict[str, Any], mark: str) -> None:
        data = json.dumps(result, separators=(",", ":"), ensure_ascii=False).encode()
        self._keep(data, mark)

    def _keep(self, data: bytes, mark: str) -> None:
        assert self._reads is not None
        self._reads.recorder.keep_later(self.key, "mcp", self.what, data, replay=mark)
