"""The relay's reading of the SDK's errors: which ones say the session is gone."""

from __future__ import annotations

from mcp.shared.exceptions import MCPError

from sandbox.guard.mcp.relay import maybe_lost


def test_lost_session_spellings() -> None:
    closed = MCPError(code=-32000, message="Connection closed")
    assert maybe_lost(closed, stdio=True) and maybe_lost(closed, stdio=False)
    gone = MCPError(code=-32600, message="Session terminated")
    assert maybe_lost(gone, stdio=False) and not maybe_lost(gone, stdio=True)
    assert not maybe_lost(MCPError(code=-32601, message="Method not found"), stdio=False)
