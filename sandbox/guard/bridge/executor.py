"""The executor hand-off: local and DB tools run in the step's container, as the step.

The executor runs as the step, so its reply is as hostile as the step: it is read
up to MAX_EXEC_REPLY_BYTES, never more, and a call whose bytes went out is never
sent again.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sandbox.contracts.guardconfig import GuardConfig
from sandbox.contracts.wire import ExecRequest, ToolResult
from sandbox.guard import limits
from sandbox.guard.bridge.client import BridgeClient
from sandbox.guard.bridge.deadline import Deadlines
from sandbox.guard.bridge.upstream import Reply, ReplyTooLarge, UpstreamError
from sandbox.stepside.agentworks_exec.pathsafety import check_tool_path
from sandbox.stepside.agentworks_exec.toolargs import executor_deadline_s

PATH_ARGUMENTS = ("path",)


class Executor:
    """The guard's one kept-alive connection to the step's executor."""

    def __init__(self, config: GuardConfig, slots: limits.ForwardSlots) -> None:
        self._grace_s = config.grace_s
        self._slots = slots  # the guard's forward slots: replies held in memory at once
        # Kept alive, a request in one write, no Nagle: a call is one round trip
        # (tests/guard/bridge/test_executor.py counts the segments).
        self._client = BridgeClient(
            f"http://127.0.0.1:{config.exec_port}", max_body=limits.MAX_EXEC_REPLY_BYTES
        )
        self._deadlines = Deadlines()
        self._headers = {
            "Authorization": f"Bearer {config.exec_token}",
            "Content-Type": "application/json",
        }

    async def aclose(self) -> None:
        await self._client.aclose()

    async def run(
        self, tool: str, arguments: dict[str, Any], outcome: dict[str, Any]
    ) -> ToolResult:
        """Run one allowed call in the step's container; `outcome` gets the reply's size."""
        for key in PATH_ARGUMENTS:
            if key in arguments:
                problem = check_tool_path(arguments[key])
                if problem is not None:
                    return ToolResult(text=f"refused: {problem}", is_error=True)
        timeout = exec_wait_s(tool, arguments, self._grace_s)
        request = ExecRequest(tool=tool, arguments=arguments)
        try:
            reply = await self._post(request.model_dump_json().encode(), timeout)
        except TimeoutError:
            return ToolResult(text=f"{tool} did not finish within {timeout:g} s", is_error=True)
        except ReplyTooLarge:
            cap = limits.MAX_EXEC_REPLY_BYTES
            outcome["reply_bytes"] = f"more than {cap}"
            return ToolResult(
                text=f"{tool}: the step's tool executor replied with more than "
                f"{limits.mib(cap)} (the guard's cap); the reply was dropped",
                is_error=True,
            )
        except UpstreamError as exc:
            if not exc.sent:
                return ToolResult(
                    text=f"the step's tool executor is not reachable: {exc}", is_error=True
                )
            return ToolResult(
                text=f"the step's tool executor failed: {exc}; the call may have run "
                "and was not repeated",
                is_error=True,
            )
        outcome["reply_bytes"] = len(reply.body)
        if reply.status != 200:
            return ToolResult(
                text=f"the step's tool executor answered {reply.status}", is_error=True
            )
        try:
            return ToolResult.model_validate_json(reply.body)
        except ValidationError:
            return ToolResult(text="the step's tool executor sent a malformed reply", is_error=True)

    async def _post(self, body: bytes, timeout: float) -> Reply:
        """One exchange with the executor, within `timeout` (a cancelled one closes its
        connection, so a late reply never answers the next call)."""
        with self._deadlines.within(timeout):
            async with self._slots:
                return await self._client.post("/v1/exec", body, self._headers)


def exec_wait_s(tool: str, arguments: dict[str, Any], grace_s: float) -> float:
    """How long the guard waits for the executor: the executor's own deadline for the
    call (`sandbox.stepside.agentworks_exec.toolargs`, the function the executor uses) plus
    the grace window."""
    return executor_deadline_s(tool, arguments) + grace_s
