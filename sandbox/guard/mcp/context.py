"""What every MCP handler of the guard shares: the run's config, its action log and the
guard's forward slots (shared with the bridge, so a flood of MCP calls cannot hold
more than the guard's memory cap allows; see `limits`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio

from sandbox.contracts.guardconfig import GuardConfig
from sandbox.guard import limits
from sandbox.guard.actionlog import ActionLog

if TYPE_CHECKING:
    from sandbox.guard.recording import Reads


class SlotTimeout(Exception):
    """No forward slot came free within the call's budget."""


class McpContext:
    def __init__(
        self, config: GuardConfig, log: ActionLog, slots: limits.ForwardSlots | None = None
    ) -> None:
        self.config = config
        self.log = log
        # The run's recording (and the replay's), set by the proxy: read results kept.
        self.reads: Reads | None = None
        self._slots = slots or limits.ForwardSlots(limits.FORWARD_SLOTS)

    @contextlib.asynccontextmanager
    async def forward_slot(self, budget_s: float) -> AsyncIterator[None]:
        """One of the guard's forward slots, waited for within the call's own budget
        (SlotTimeout past it)."""
        if not self._slots.try_acquire():  # a free slot: taken without a wait (no timer)
            try:
                with anyio.fail_after(budget_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise SlotTimeout() from None
        try:
            yield
        finally:
            self._slots.release()

    async def log_line(
        self,
        *,
        tool: str,
        decision: str,
        reason: str,
        arguments: dict[str, Any],
        started: float,
        detail: dict[str, Any] | None = None,
        category: str = "mcp",
    ) -> None:
        """One finished line (a stub or a refusal) for the run's action log."""
        await self.log.write(
            session="root",
            tool=tool,
            decision=decision,
            reason=reason,
            category=category,
            arguments=arguments,
            duration_ms=(time.perf_counter() - started) * 1000,
            detail=detail,
        )
