"""An allowed MCP call's result recorded, and answered from a replay.

The key is the server, the tool and the arguments (`key_of("mcp", ...)`). A result
the server answered (no protocol error) is kept as its wire JSON. In a replay the
tool list is still asked live (the policy judges the server's annotations as they
are now); a hit is the recorded result without the call reaching the server; a miss
is a `TEST MODE` replay-miss error result, or goes out with misses live.
"""

from __future__ import annotations

import json
from typing import Any

from sandbox.contracts.recording import key_of, miss_text
from sandbox.guard.recording import Reads


class Recorded:
    """One allowed call's key, and its result's way in and out of the recording."""

    def __init__(self, reads: Reads | None, server: str, tool: str, arguments: dict[str, Any]):
        self._reads = reads
        self.key = key_of("mcp", server=server, tool=tool, arguments=arguments)
        self.what = f"mcp {server}/{tool}"
        self._mark = ""

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
        """A result the server answered, kept (not a guard-made error)."""
        if self._reads is None or "error" in outcome:
            return
        data = json.dumps(result, separators=(",", ":"), ensure_ascii=False).encode()
        self._keep(data, self._mark)

    def _keep(self, data: bytes, mark: str) -> None:
        assert self._reads is not None
        self._reads.recorder.tap(self.key, "mcp", self.what, replay=mark).whole(data)
