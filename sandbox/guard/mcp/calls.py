"""The judged `tools/call`: the live tool lookup, the policy's verdict, and the call.

The server's tool list is asked afresh for every call and its annotations are
taken exactly as sent (raw JSON, so `"readOnlyHint": "true"` is not read as
true), because a server may change them between calls. `policy.decide_mcp` decides;
a stub is one log line and a successful stub result; an allowed call gets its
`start` line before it is sent and its `outcome` line before the result goes back.
Nothing raises out of a call except the server's own protocol error."""

from __future__ import annotations

import time
from typing import Any

import mcp_types as types
from mcp.shared.exceptions import MCPError

from sandbox import policy
from sandbox.guard.actionlog import LogFull
from sandbox.guard.mcp.context import McpContext, SlotTimeout
from sandbox.guard.mcp.recorded import Recorded
from sandbox.guard.mcp.relay import (
    McpReplyTooLarge,
    McpServerError,
    Upstream,
    describe,
    tool_call,
)
from sandbox.guard.mcp.schema_instance import valid_instance


def stub_result(tool: str, reason: str, output_schema: Any) -> tuple[dict[str, Any], bool | None]:
    """The stub `CallToolResult` (wire JSON) and whether its structured content validates."""
    result: dict[str, Any] = {
        "content": [{"type": "text", "text": policy.stub_reply(tool, reason)}],
        "isError": False,
        "resultType": "complete",
    }
    if not isinstance(output_schema, dict):
        return result, None
    instance, valid = valid_instance(output_schema)
    result["structuredContent"] = instance
    return result, valid


def annotations_of(tool: dict[str, Any] | None) -> dict[str, Any] | None:
    """The tool's `annotations` object exactly as the server sent it (None when absent)."""
    if tool is None:
        return None
    annotations = tool.get("annotations")
    return annotations if isinstance(annotations, dict) else None


def error_result(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True, "resultType": "complete"}


class ToolCalls:
    """The `tools/call`s of one server's endpoint."""

    def __init__(self, context: McpContext, upstream: Upstream) -> None:
        self.context = context
        self.upstream = upstream
        self.name = upstream.name

    async def call_tool(self, params: types.CallToolRequestParams) -> dict[str, Any]:
        """One call, inside one of the guard's forward slots: its tool listing and its
        result are what the guard holds for it (see caps). The SDK's handler and the
        hot path both end here, so their policy and log lines are one code."""
        started = time.perf_counter()
        budget = self.context.config.budget_for(f"mcp:{self.name}/{params.name}")
        try:
            async with self.context.forward_slot(budget):
                return await self._judged_call(params, started, budget)
        except SlotTimeout:
            reason = f"the guard had no free forward slot within {budget:g} s"
            await self.context.log_line(
                tool=f"mcp:{self.name}/{params.name}",
                decision="stub",
                reason=reason,
                arguments=dict(params.arguments or {}),
                started=started,
                detail={"server": self.name, "tool": params.name},
            )
            return stub_result(params.name, reason, None)[0]

    async def _judged_call(
        self, params: types.CallToolRequestParams, started: float, budget: float
    ) -> dict[str, Any]:
        tool = params.name
        arguments = dict(params.arguments or {})
        override = self.upstream.server.read_only_overrides.get(tool)
        lookup_budget = self.upstream.server.lookup_budget_s
        detail: dict[str, Any] = {"server": self.name, "tool": tool}
        if override is not None:
            detail["override"] = {"read_only": override}
        lookup_error: str | None = None
        listed_tool: dict[str, Any] | None = None
        t0 = time.perf_counter()
        try:
            tools = await self.upstream.list_tools(lookup_budget)
            listed_tool = next((t for t in tools if t.get("name") == tool), None)
            del tools  # only this tool's entry is kept while the call runs
        except TimeoutError:
            lookup_error = f"tools/list did not answer within {lookup_budget:g} s"
        except McpServerError as exc:
            lookup_error = exc.reason
        except MCPError as exc:
            lookup_error = f"tools/list failed: {exc.message}"
        except Exception as exc:  # fail closed on anything unexpected
            lookup_error = f"tools/list failed: {describe(exc)}"
        detail["lookup_ms"] = round((time.perf_counter() - t0) * 1000, 3)
        annotations = annotations_of(listed_tool)
        detail["listed"] = listed_tool is not None
        detail["annotations"] = annotations
        verdict = policy.decide_mcp(
            annotations,
            listed=listed_tool is not None,
            lookup_error=lookup_error,
            override_read_only=override,
        )
        if verdict.decision is not policy.Decision.ALLOW:
            schema = listed_tool.get("outputSchema") if listed_tool is not None else None
            result, valid = stub_result(tool, verdict.reason, schema)
            if valid is not None:
                detail["structured_content_valid"] = valid
            await self.context.log_line(
                tool=f"mcp:{self.name}/{tool}",
                decision="stub",
                reason=verdict.reason,
                arguments=arguments,
                started=started,
                detail=detail,
            )
            return result

        call = tool_call(tool, params.arguments)
        try:
            logged = await self.context.log.begin(
                session="root",
                tool=f"mcp:{self.name}/{tool}",
                decision="allow",
                reason=verdict.reason,
                category="mcp",
                arguments=arguments,
                detail=detail,
                durable=False,  # written now; the outcome's sync covers it before the reply
            )
        except LogFull as full:
            result, _ = stub_result(tool, str(full), None)
            return result
        outcome: dict[str, Any] = {}
        t1 = time.perf_counter()
        error: MCPError | None = None
        recorded = Recorded(self.context.reads, self.name, tool, arguments)
        async with self.context.log.settled_on_exception():  # answered without an outcome
            try:
                replayed = recorded.replayed(outcome)
                if replayed is not None:
                    result = replayed
                else:
                    result = await self.upstream.request(call, budget, retry=False)
                    recorded.keep(result, outcome)
            except McpReplyTooLarge as exc:
                result = error_result(f"{tool}: {exc.reason}")
                outcome["error"] = exc.reason
                outcome["reply_too_large"] = True
            except McpServerError as exc:
                result = error_result(f"{tool}: the MCP server {self.name} failed: {exc.reason}")
                outcome["error"] = exc.reason
            except TimeoutError:
                reason = f"no answer within its time budget of {budget:g} s"
                result = error_result(f"{tool}: the MCP server {self.name} failed: {reason}")
                outcome["error"] = reason
            except MCPError as exc:  # a protocol error from the server: passed on as one
                error = exc
                result = {}
                outcome["error"] = f"{exc.code}: {exc.message}"[:300]
        outcome["upstream_ms"] = round((time.perf_counter() - t1) * 1000, 3)
        if result.get("isError") is True:
            outcome["is_error"] = True
        failed = error is not None or "error" in outcome or outcome.get("is_error") is True
        await self.context.log.outcome(logged, ok=not failed, detail=outcome)
        if error is not None:
            raise error
        return result
