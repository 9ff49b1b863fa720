"""The bridge's answers: every tool call is checked, logged, then answered.

One call: parse -> policy decision (on the arguments the step controls) -> bind
the tool's identity paths (`bindings`) -> run by route (stub, refuse, session
here; upstream, executor in `forward` and `executor`) -> action-log line(s) ->
reply. Nothing raises out of a call (see bridge.spec.md).
"""

from __future__ import annotations

import json
import secrets
import time
from functools import cached_property
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from sandbox import policy
from sandbox.contracts.guardconfig import GuardConfig
from sandbox.contracts.wire import (
    SessionReply,
    SessionRequest,
    ToolCall,
    ToolReply,
    ToolResult,
    json_of,
    reply_json,
)
from sandbox.guard import limits
from sandbox.guard.actionlog import ActionLog, LogFull, Started
from sandbox.guard.auth import bearer_ok, reject_and_log
from sandbox.guard.bridge import bindings
from sandbox.guard.recording import Reads
from sandbox.guard.requestcaps import json_bytes

if TYPE_CHECKING:
    from sandbox.guard.bridge.executor import Executor
    from sandbox.guard.bridge.recorded import RecordedForward
    from sandbox.guard.egress.proxy import EgressProxy

# The bridge's ways out (the executor's and the upstream's clients, with httptools),
# imported with the web stack: no bridge call is answered before it serves, and the
# guard's start-up does not load them before the preflight's proofs
# (`sandbox.guard.startup`).
WAYS_OUT_MODULES = ("sandbox.guard.bridge.executor", "sandbox.guard.bridge.recorded")

ROOT_SESSION = "root"
# The enums a call compares with, read once: a class attribute of an enum (or of a
# pydantic model) goes through its metaclass's `__getattr__` hook on every read.
_STUB, _REFUSE, _REDIRECT = policy.Decision.STUB, policy.Decision.REFUSE, policy.Decision.REDIRECT
_SESSION, _UPSTREAM = policy.Route.SESSION, policy.Route.UPSTREAM
_RUNNABLE = (policy.Route.LOCAL, policy.Route.DB, policy.Route.UPSTREAM)
_SESSION_BOUND = bindings.Bound.SESSION
# Each tool's bound paths as the start line names them (the table is fixed at import).
_BOUND_NAMES = {
    tool: tuple(".".join(path) for path in paths)
    for tool, paths in bindings.IDENTITY_BINDINGS.items()
}


class Sessions:
    """Every session here is a test session; there is no call that makes one that is not."""

    def __init__(self) -> None:
        self._parent: dict[str, str | None] = {ROOT_SESSION: None}

    def known(self, session: str) -> bool:
        return session in self._parent

    def child(self, parent: str) -> str:
        session = f"s-{secrets.token_hex(6)}"
        self._parent[session] = parent
        return session

    def parent_of(self, session: str) -> str | None:
        return self._parent.get(session)


class Guard:
    """One run's guard: the policy check, the log, and the ways out."""

    def __init__(self, config: GuardConfig, log: ActionLog) -> None:
        self.config = config
        self.log = log
        self.sessions = Sessions()
        # Bridge calls in flight, so an egress line can name the tool call active then.
        self._inflight: dict[int, tuple[str, str | None]] = {}  # tool, session
        self.egress: EgressProxy | None = None  # set while the app runs
        # Forwarded calls whose reply may be held in memory at once (see limits).
        self.forward_slots = limits.ForwardSlots(limits.FORWARD_SLOTS)
        self._next_call = 0
        self.reads = Reads.from_config(config.data_dir, config.recording, config.replay)
        # The config is frozen: what every call reads of it, read once.
        self._has_db = config.has_db
        self._run_identity = {
            bindings.Bound.RUN_ID: config.run_id,
            bindings.Bound.WORKFLOW: config.workflow,
            bindings.Bound.STEP: config.step,
            bindings.Bound.RUN_KIND: "test",
        }

    @cached_property
    def upstream(self) -> RecordedForward:
        """Forwards a call to the run's upstream (or its recording), made at first use."""
        from sandbox.guard.bridge.forward import UpstreamForward
        from sandbox.guard.bridge.recorded import RecordedForward

        return RecordedForward(UpstreamForward(self.config, self.forward_slots), self.reads)

    @cached_property
    def executor(self) -> Executor:
        """Runs a call in the step's executor, made at first use."""
        from sandbox.guard.bridge.executor import Executor

        return Executor(self.config, self.forward_slots)

    def active_calls(self) -> list[str]:
        # named here, not per call: an egress line asks, a call does not
        return sorted(
            {
                f"{tool} (session {session or ROOT_SESSION})"
                for tool, session in self._inflight.values()
            }
        )

    def idle(self) -> bool:
        """No bridge call in flight and no egress connection open: nothing left to record."""
        return not self._inflight and (self.egress is None or self.egress.open_connections == 0)

    async def close(self) -> None:
        made = vars(self)  # a way out never used was never made: nothing to close
        if "upstream" in made:
            await self.upstream.aclose()
        if "executor" in made:
            await self.executor.aclose()
        self.reads.close()
        self.log.close()

    # -- the answers ---------------------------------------------------------------
    # Bytes in, status and body bytes out, each line on disk first: the HTTP side is
    # the front's (`sandbox.guard.bridge.front`).

    def authorized(self, authorization: str | bytes) -> bool:
        return bearer_ok(authorization, self.config.bridge_token)

    async def refused(
        self, status: int, reason: str, started: float, tool: str = "?"
    ) -> tuple[int, bytes]:
        """A refusal's line (category `request`), then its status and body bytes."""
        response = await reject_and_log(
            self.log, status, reason, tool=tool, session="?", started=started
        )
        return response.status_code, bytes(response.body)

    async def answer_call(self, body: bytes, started: float) -> tuple[int, bytes]:
        """One authorized tool call's whole body in, its status and reply bytes out, its
        line(s) on disk first."""
        try:
            call = ToolCall.model_validate_json(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return await self.refused(400, f"malformed request: {where}: {first['msg']}", started)
        self._next_call += 1
        call_id = self._next_call
        self._inflight[call_id] = (call.tool, call.session)
        try:
            reply, detail, category, logged = await self._handle(call, len(body))
        finally:
            del self._inflight[call_id]
        if isinstance(reply, bytes):  # forwarded: both lines written, the reply encoded
            return 200, reply
        if not logged:  # a forwarded call has its start and outcome lines already;
            # a call the full log refused is counted there (as the MCP proxy does)
            await self.log.write(
                session=reply.session,
                tool=call.tool,
                decision=reply.decision,
                reason=reply.reason,
                category=category,
                arguments=bindings.without_bound(call.tool, call.arguments),
                duration_ms=(time.perf_counter() - started) * 1000,
                detail=detail,
            )
        # Serialized by pydantic straight to bytes (no dict, no second encoder).
        return 200, json_of(reply)

    async def answer_session(self, body: bytes | None, started: float) -> tuple[int, bytes]:
        """An authorized session request's body (None: past the cap) in, status and
        reply bytes out, its line on disk first."""
        try:
            asked = SessionRequest.model_validate_json(body or b"{}")
        except ValidationError:
            return await self.refused(400, "malformed session request", started)
        parent = asked.parent or ROOT_SESSION
        if not self.sessions.known(parent):
            return await self.refused(400, f"unknown parent session {parent!r}", started)
        session = self.sessions.child(parent)
        await self.log.write(
            session=session,
            tool="session.create",
            decision="allow",
            reason="child sessions inherit test mode",
            category="session",
            arguments={"parent": parent},
            duration_ms=(time.perf_counter() - started) * 1000,
        )
        return 200, json_bytes(SessionReply(session=session, parent=parent).model_dump())

    def health_body(self) -> bytes:
        return json_bytes({"ok": True, "run_id": self.config.run_id})

    # -- one call ------------------------------------------------------------------

    async def _handle(
        self, call: ToolCall, request_bytes: int
    ) -> tuple[ToolReply | bytes, dict[str, Any], str, bool]:
        """The reply (a forwarded call's already as its JSON), the one-line detail, the
        category, and whether the call's lines are taken care of here (a forwarded
        call's start and outcome; a call the full log refused, which the log has
        counted) rather than by the caller's one line."""
        # Each field read once: every read of a model's attribute goes through the
        # `__getattr__` hook pydantic's models have.
        tool, given = call.tool, call.arguments
        session = call.session or ROOT_SESSION
        if not self.sessions.known(session):
            reason = f"unknown session {session!r}; create one with POST /v1/sessions"
            return _refusal(tool, ROOT_SESSION, reason), {}, "session", False
        # What the step controls: judged, and written in the start line (the same dict;
        # neither the policy nor the line changes it).
        own = bindings.without_bound(tool, given)
        verdict = policy.decide(tool, own, has_db_copy=self._has_db)
        kind, why, category = verdict.decision, verdict.reason, verdict.category
        detail: dict[str, Any] = {}
        if verdict.fails_step:
            detail["fails_step"] = True
        if kind is _STUB:
            return _stub(tool, session, why), detail, category, False
        if kind is _REFUSE:
            return _refusal(tool, session, why), detail, category, False

        # After the verdict, before anything runs: the tool's bound paths hold the guard's
        # values, whatever the step put there; every other argument is the step's own.
        try:
            arguments = bindings.bind(tool, given, self._identity(session))
        except bindings.UnboundIdentity as exc:
            return _refusal(tool, session, str(exc)), detail, category, False
        bound = _BOUND_NAMES.get(tool)
        if bound:
            detail["bound"] = list(bound)
            overwritten = bindings.overwritten(tool, given)
            if overwritten:
                detail["overwrote"] = overwritten
        route = verdict.route
        decision = "redirect" if kind is _REDIRECT else "allow"
        if route is _SESSION:
            child = self.sessions.child(session)
            result = ToolResult(
                text=f"{tool} runs inside this test run as child test session {child}; "
                "pass session={child} on its calls.",
                data={"session": child, "parent": session, "test_mode": True},
            )
            detail["child_session"] = child
            reply = _answered(tool, session, decision, why, result)
            return reply, detail, category, False
        if route not in _RUNNABLE:
            # a route the guard does not know: fail closed
            reason = f"no way to run route {route.value}"
            return _stub(tool, session, reason), detail, category, False

        if route is _UPSTREAM:
            detail["budget_s"] = self.config.budget_for(tool)
        detail["request_bytes"] = request_bytes
        try:
            logged = await self.log.begin(
                session=session,
                tool=tool,
                decision=decision,
                reason=why,
                category=category,
                arguments=own,
                detail=detail,
                durable=False,  # written now; the outcome's sync covers it before the reply
            )
        except LogFull as full:  # stubbed, never forwarded unlogged; the log counted it
            return _stub(tool, session, str(full)), {}, category, True
        outcome: dict[str, Any] = {}
        async with self.log.settled_on_exception():  # answered without an outcome: synced first
            result_json = None  # the result's JSON, when the recording made it already
            if route is _UPSTREAM:
                result, result_json = await self.upstream.call(
                    tool, arguments, session, outcome, own
                )
            else:
                result = await self.executor.run(tool, arguments, outcome)
        await self._outcome(logged, result, outcome)
        # Every field is checked already (the step's ToolCall, the verdict, the result's
        # own model): encoded without a reply model (`reply_json`).
        encoded = reply_json(
            ok=not result.is_error,
            tool=tool,
            session=session,
            decision=decision,
            reason=why,
            result=result,
            result_json=result_json,
        )
        return encoded, detail, category, True

    def _identity(self, session: str) -> dict[bindings.Bound, str]:
        return {**self._run_identity, _SESSION_BOUND: session}

    async def _outcome(self, logged: Started, result: ToolResult, detail: dict[str, Any]) -> None:
        if result.is_error:
            detail["error"] = result.text[:500]
        if "reply_bytes" not in detail:  # the forward counted the reply's bytes already
            detail["reply_bytes"] = len(result.text) + len(json.dumps(result.data))
        await self.log.outcome(logged, ok=not result.is_error, detail=detail)


def _answered(tool: str, session: str, decision: str, reason: str, result: ToolResult) -> ToolReply:
    """An allowed or redirected call's reply: ok unless its result is an error."""
    return ToolReply(
        ok=not result.is_error,
        tool=tool,
        session=session,
        decision=decision,  # type: ignore[arg-type]
        reason=reason,
        result=result,
    )


def _stub(tool: str, session: str, reason: str) -> ToolReply:
    return ToolReply(
        ok=True,
        tool=tool,
        session=session,
        decision="stub",
        reason=reason,
        result=ToolResult(text=policy.stub_reply(tool, reason)),
    )


def _refusal(tool: str, session: str, reason: str) -> ToolReply:
    return ToolReply(
        ok=False,
        tool=tool,
        session=session,
        decision="refuse",
        reason=reason,
        result=ToolResult(text=f"TEST MODE: {tool} was refused ({reason}).", is_error=True),
    )
