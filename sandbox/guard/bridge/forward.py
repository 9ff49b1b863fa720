"""The upstream forward: allowed non-local calls go to the real bridge, as the guard
says who calls.

The identity fields are the guard's (`UpstreamCall`), the whole exchange keeps to
the tool's time budget, the reply is read up to MAX_UPSTREAM_REPLY_BYTES, and a
call whose bytes went out is never sent again: the upstream may have run it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from pydantic_core import to_json

from sandbox.contracts.guardconfig import GuardConfig
from sandbox.contracts.wire import RUN_KIND_HEADER, ToolResult, UpstreamCall
from sandbox.guard import limits
from sandbox.guard.bridge.client import BridgeClient
from sandbox.guard.bridge.deadline import Deadlines
from sandbox.guard.bridge.upstream import ReplyTooLarge, UpstreamError


def upstream_body(
    *, tool: str, arguments: dict[str, Any], run_id: str, session: str, workflow: str, step: str
) -> bytes:
    """`UpstreamCall(...).model_dump_json()`'s bytes, without a model per call: the
    arguments were validated at the bridge's boundary (the step's `ToolCall`), every
    other field is the guard's own string, so a second validation checks nothing; the
    serializer is the model's own (pydantic-core's `to_json`, NaN and infinity as null as
    the model writes them). tests/guard/bridge/test_forward.py holds it to the model."""
    fields = {
        "tool": tool,
        "arguments": arguments,
        "run_id": run_id,
        "session": session,
        "workflow": workflow,
        "step": step,
        "run_kind": _RUN_KIND,
    }
    return to_json(fields, inf_nan_mode="null")


_HEADERS = {RUN_KIND_HEADER: "test", "Content-Type": "application/json"}
_RUN_KIND = UpstreamCall.model_fields["run_kind"].default  # "test": the only kind a guard sends


class UpstreamForward:
    """The guard's kept-alive client to the real bridge, if the run has one."""

    def __init__(self, config: GuardConfig, slots: limits.ForwardSlots) -> None:
        self._config = config
        self._slots = slots  # the guard's forward slots: replies held in memory at once
        self._client = BridgeClient(config.upstream) if config.upstream else None
        self._deadlines = Deadlines()
        # The config is frozen: what every call reads of it, read once.
        self._run_id, self._workflow, self._step = config.run_id, config.workflow, config.step

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def call(
        self, tool: str, arguments: dict[str, Any], session: str, detail: dict[str, Any]
    ) -> ToolResult:
        """One allowed call to the real bridge; `detail` gets the outcome's facts
        (status, time-out, reply size)."""
        if self._client is None:
            return ToolResult(text=f"{tool}: no upstream bridge is configured", is_error=True)
        budget = self._config.budget_for(tool)
        body = upstream_body(
            tool=tool,
            arguments=arguments,
            run_id=self._run_id,
            session=session,
            workflow=self._workflow,
            step=self._step,
        )
        try:
            # The whole exchange within the budget. A call whose bytes went out is never
            # sent again (sandbox.guard.bridge.upstream): the upstream may have run it.
            with self._deadlines.within(budget):
                async with self._slots:
                    reply = await self._client.post("/v1/tools/call", body, _HEADERS)
        except TimeoutError:
            detail["timed_out"] = True
            return ToolResult(
                text=f"{tool} exceeded its time budget of {budget:g} s and was abandoned",
                is_error=True,
            )
        except ReplyTooLarge:
            cap = limits.MAX_UPSTREAM_REPLY_BYTES
            detail["reply_bytes"] = f"more than {cap}"
            return ToolResult(
                text=f"{tool}: the upstream bridge's reply was larger than {limits.mib(cap)} "
                "(the guard's cap); it was dropped",
                is_error=True,
            )
        except UpstreamError as exc:
            detail["upstream_error"] = str(exc)
            if not exc.sent:
                return ToolResult(text=f"upstream bridge unreachable: {exc}", is_error=True)
            return ToolResult(
                text=f"upstream bridge failed: {exc}; the call may or may not have run "
                "upstream and was not repeated",
                is_error=True,
            )
        detail["upstream_status"] = reply.status
        body = reply.body
        detail["reply_bytes"] = len(body)
        if reply.status != 200:
            text = body[:300].decode("utf-8", errors="replace")
            return ToolResult(
                text=f"upstream bridge answered {reply.status}: {text}", is_error=True
            )
        try:
            return ToolResult.model_validate_json(body)
        except ValidationError:
            try:
                return ToolResult(text=json.dumps(json.loads(body))[:100_000])
            except ValueError:
                return ToolResult(text="upstream bridge sent a malformed reply", is_error=True)
