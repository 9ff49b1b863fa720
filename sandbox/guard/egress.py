"""The egress proxy (placeholder until the egress issue lands: nothing listens)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from sandbox.guard.actionlog import ActionLog
from sandbox.guard.config import GuardConfig


@contextlib.asynccontextmanager
async def running(config: GuardConfig, log: ActionLog) -> AsyncIterator[None]:
    yield
