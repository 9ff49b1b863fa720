"""The bridge's wire format: every request and reply the guard speaks, as pydantic models.

Three hops use it: step -> guard (`/v1/tools/call`), guard -> step executor
(local and DB tools, `/v1/exec`), and guard -> real bridge upstream
(`/v1/tools/call` with the guard's identity fields and the
`X-Agentworks-Run-Kind: test` header). Every reply is a tool result an agent
can read; a refusal or a stub is never an HTTP error, only a bad token or a
malformed body is.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_json

from sandbox.contracts.guardprocess import MAX_REQUEST_BYTES as MAX_REQUEST_BYTES

RUN_KIND_HEADER = "X-Agentworks-Run-Kind"


class ToolCall(BaseModel):
    """What a step sends: a tool, its arguments, optionally its session."""

    model_config = ConfigDict(extra="forbid")

    tool: str = Field(min_length=1, max_length=200)
    arguments: dict[str, Any] = Field(default_factory=dict)
    session: str | None = Field(default=None, max_length=100)


class ToolResult(BaseModel):
    text: str = ""
    data: Any = None
    is_error: bool = False


class ToolReply(BaseModel):
    """What the step gets back. A stub is `ok=True` with the stub text as its result."""

    ok: bool
    tool: str
    session: str
    decision: Literal["allow", "stub", "redirect", "refuse"]
    reason: str = ""
    result: ToolResult = Field(default_factory=ToolResult)


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    parent: str | None = None


class SessionReply(BaseModel):
    session: str
    parent: str | None
    test_mode: Literal[True] = True


class UpstreamCall(BaseModel):
    """Guard -> real bridge. Identity fields are the guard's, never the step's."""

    tool: str
    arguments: dict[str, Any]
    run_id: str
    session: str
    workflow: str
    step: str
    run_kind: Literal["test"] = "test"


class ExecRequest(BaseModel):
    """Guard -> executor in the step container: run one local or DB tool."""

    model_config = ConfigDict(extra="forbid")

    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ErrorReply(BaseModel):
    error: str


class ActionLine(BaseModel):
    """One entry of `test_mode_actions.jsonl` (written by the guard alone).

    `event` says which: `call` is a whole call answered inside the guard (stub,
    refusal, session), written before the reply; `start` is a forwarded call's
    line before any of it leaves the guard (what was asked, the decision), and
    `outcome` its second line after (`outcome` ok or error, `duration_ms`, sizes
    in `detail`), both carrying the same `call_id`; `log_full` marks the point
    where the log reached its cap (later calls are stubbed without a line). `step`
    names the workflow step whose guard wrote the line, so the lines of a chain's
    steps read apart wherever they are joined."""

    time: datetime
    step: str = ""
    session: str
    tool: str
    decision: Literal["allow", "stub", "redirect", "refuse"]
    reason: str
    category: str = ""
    arguments: dict[str, Any] = Field(default_factory=dict)
    duration_ms: float | None = None
    detail: dict[str, Any] = Field(default_factory=dict)
    event: Literal["call", "start", "outcome", "log_full"] = "call"
    call_id: str | None = Field(default=None, max_length=40)
    outcome: Literal["ok", "error"] | None = None


def json_of(model: BaseModel) -> bytes:
    """`model.model_dump_json().encode()`'s bytes from the model's own serializer, without
    the text made from them and encoded back (twice per forwarded call on the bridge)."""
    return model.__pydantic_serializer__.to_json(model)


def reply_json(
    *,
    ok: bool,
    tool: str,
    session: str,
    decision: str,
    reason: str,
    result: ToolResult,
    result_json: bytes | None = None,
) -> bytes:
    """`json_of(ToolReply(...))`'s bytes, without the reply model: for a reply made of
    values the guard has checked already (the step's validated `ToolCall`, the
    verdict's decision and reason, a `ToolResult`), so that validating them again
    checks nothing. The fields in the model's order, to the model's own serializer
    (the result through its own, NaN and infinity as null as the models write them);
    tests/contracts/test_wire.py holds it to the model. `result_json`: `json_of(result)`
    when it was made already (a forwarded answer's, for its recording), placed as it is
    rather than made again."""
    fields = {
        "ok": ok,
        "tool": tool,
        "session": session,
        "decision": decision,
        "reason": reason,
    }
    if result_json is not None:
        # the last field: the rest's object, its closing brace replaced by the result
        return to_json(fields, inf_nan_mode="null")[:-1] + b',"result":' + result_json + b"}"
    fields["result"] = result
    return to_json(fields, inf_nan_mode="null")
