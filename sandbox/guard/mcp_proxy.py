"""The MCP proxy: every MCP server of the workflow, reachable from the step only here.

(Placeholder until the MCP issue lands: no servers are proxied, no routes are served.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.routing import BaseRoute

from sandbox.guard.actionlog import ActionLog
from sandbox.guard.config import GuardConfig


class McpProxy:
    def __init__(self, config: GuardConfig, log: ActionLog) -> None:
        self.config = config
        self.log = log

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    def routes(self) -> list[BaseRoute]:
        return []
