"""One action-log line: what a guarded call's arguments become before they are written.

Redaction (argument keys that name a credential, this run's own tokens) and size caps
(long strings cut and hashed, long containers cut, deep nesting stopped, a line past
MAX_LINE_BYTES reduced to its arguments' size and hash), so a hostile step or server
can neither leak a secret into the log nor make a line cost the host. `action_line`
makes the whole line (every line of the log goes through it); `encode_line` writes the
same bytes as `ActionLine(...).model_dump_json()`, without a model per line.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from itertools import islice
from typing import Any

from pydantic_core import to_json

from sandbox.contracts.wire import ActionLine
from sandbox.guard.memo import remember

REDACTED = "[redacted]"
# The one list of words that mark a credential: in an argument's key here, in a forwarded
# header's name in the egress log (`egress.lines`).
SECRET_WORDS = (
    r"pass(word|wd)?|secret|token|api[_-]?key|auth(orization)?|cookie|credential"
    r"|private[_-]?key|signature"
)
_SECRET_KEY = re.compile(SECRET_WORDS, re.IGNORECASE)
MAX_VALUE_CHARS = 2000  # one string value; past it: cut, with the whole value's SHA-256
MAX_ITEMS = 200  # entries of one list or object
MAX_LINE_BYTES = 64 * 1024  # one line; past it the arguments become their size and hash


def _digest(data: str) -> str:
    return hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()


# Short argument keys known not to name a credential. Keys repeat call after call, so
# a short key's answer is remembered, as keys a line's loop asks without a call (at
# most MEMO_KEYS keys of at most MEMO_KEY_CHARS characters, emptied when full:
# `sandbox.guard.memo`; a hostile step cannot make the memo cost memory); a
# credential's key, or a longer one, is searched each time.
MEMO_KEYS = 1024
MEMO_KEY_CHARS = 64
_PLAIN_KEYS: dict[str, None] = {}


def _secret_key(key: str) -> bool:
    """Whether an argument key names a credential (one not in _PLAIN_KEYS)."""
    if _SECRET_KEY.search(key) is not None:
        return True
    remember(_PLAIN_KEYS, key, None, entries=MEMO_KEYS, longest=MEMO_KEY_CHARS)
    return False


_SCALARS = (bool, int, float, type(None))
MAX_DEPTH = 20


# The last secrets tuple asked and its floor, swapped as one tuple (a line's loop asks
# it by identity, with no call and no hash of the tuple: a log's secrets are the same
# tuple on every line).
_FLOOR_MEMO: tuple[tuple[str, ...], int] = ((), MAX_VALUE_CHARS + 1)


def _floor(secrets: tuple[str, ...]) -> int:
    """The length below which a string is its own `redact_text`: shorter than every
    (non-empty) secret, it cannot hold one, and it is not long enough to be cut. A
    pure function of `secrets`; the last answer is kept in _FLOOR_MEMO."""
    global _FLOOR_MEMO
    floor = min([len(s) for s in secrets if s] + [MAX_VALUE_CHARS + 1])
    _FLOOR_MEMO = (secrets, floor)
    return floor


def redact_text(value: str, secrets: tuple[str, ...]) -> str:
    """`redact` of a string: known secrets masked, a long one cut and hashed."""
    for secret in secrets:
        if secret and secret in value:
            value = value.replace(secret, REDACTED)
    if len(value) > MAX_VALUE_CHARS:
        cut = len(value) - MAX_VALUE_CHARS
        return value[:MAX_VALUE_CHARS] + f"[... {cut} chars cut; sha256 {_digest(value)}]"
    return value


_SEQUENCES = (list, tuple)


def redact(value: Any, secrets: tuple[str, ...] = (), depth: int = 0) -> Any:
    """A copy of `value` safe and small enough to write down: credential keys and known
    secrets masked, long strings cut and hashed, long containers cut, nothing below
    MAX_DEPTH levels. (On every log line: a container's strings and numbers are
    handled in place, without a call each; a string too short to hold any secret,
    see `_floor`, is kept as it is without the search.)"""
    if depth > MAX_DEPTH:
        return "[too deep]"
    if type(value) is not dict:  # a line's arguments and detail: a dict, tested first
        if isinstance(value, str):
            return redact_text(value, secrets)
        if isinstance(value, _SCALARS):
            return value
    inner = depth + 1
    leaf_ok = inner <= MAX_DEPTH
    memo = _FLOOR_MEMO
    floor = memo[1] if memo[0] is secrets else _floor(secrets)
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        items = value.items() if len(value) <= MAX_ITEMS else islice(value.items(), MAX_ITEMS)
        for k, v in items:
            key = str(k)
            kind = type(v)
            # a credential's key (a short plain key's answer remembered: _PLAIN_KEYS)
            if key not in _PLAIN_KEYS and _secret_key(key):
                out[key] = REDACTED
            elif leaf_ok and kind is str:
                out[key] = v if len(v) < floor else redact_text(v, secrets)
            elif leaf_ok and kind in _SCALARS:
                out[key] = v
            else:
                out[key] = redact(v, secrets, inner)
        if len(value) > MAX_ITEMS:
            out["[cut]"] = f"{len(value) - MAX_ITEMS} more keys"
        return out
    if isinstance(value, _SEQUENCES):
        # a string or a number as the loop above takes it (a start line's `bound` list,
        # an egress line's forwarded head)
        kept = []
        for v in value if len(value) <= MAX_ITEMS else value[:MAX_ITEMS]:
            kind = type(v)
            if leaf_ok and kind is str:
                kept.append(v if len(v) < floor else redact_text(v, secrets))
            elif leaf_ok and kind in _SCALARS:
                kept.append(v)
            else:
                kept.append(redact(v, secrets, inner))
        if len(value) > MAX_ITEMS:
            kept.append(f"[... {len(value) - MAX_ITEMS} more items cut]")
        return kept
    return redact(str(value), secrets, inner)


def _summarized(value: dict[str, Any]) -> dict[str, Any]:
    """What stands in for arguments or detail too large for one line."""
    text = json.dumps(value, sort_keys=True, default=str)
    return {"[cut]": f"{len(text)} bytes as JSON; sha256 {_digest(text)}"}


# ActionLine's fields, in its order; the values `encode_line` checks as the model would.
_FIELDS = (
    "session",
    "tool",
    "decision",
    "reason",
    "category",
    "arguments",
    "duration_ms",
    "detail",
    "event",
    "call_id",
    "outcome",
)
_DECISIONS = frozenset({"allow", "stub", "redirect", "refuse"})
_EVENTS = frozenset({"call", "start", "outcome", "log_full"})
_OUTCOMES = frozenset({None, "ok", "error"})


def action_line(
    step: str,
    secrets: tuple[str, ...],
    event: str,
    call_id: Any,
    outcome: Any,
    session: Any,
    tool: Any,
    decision: Any,
    reason: Any,
    category: Any,
    arguments: Any,
    duration_ms: Any,
    detail: Any,
) -> bytes:
    """One action line as written to the log (newline included): its arguments and
    detail redacted (`redact`), its tool cut to 200 characters, its reason's secrets
    masked, its duration rounded to the microsecond, the time now; arguments and
    detail too large for a line become their size and hash (`_summarized`)."""
    # an empty dict (an outcome line's arguments) is its own redaction: not walked
    arguments = {} if type(arguments) is dict and not arguments else redact(arguments, secrets)
    detail = redact(detail or {}, secrets)
    tool = str(tool)[:200]
    if type(reason) is str:
        memo = _FLOOR_MEMO
        if len(reason) >= (memo[1] if memo[0] is secrets else _floor(secrets)):
            reason = redact_text(reason, secrets)
    else:
        reason = redact_text(str(reason), secrets)
    if duration_ms is not None:
        duration_ms = round(duration_ms, 3)
    now = datetime.now(UTC)
    data = encode_line(
        now, step, session, tool, decision, reason, category, arguments, duration_ms, detail,
        event, call_id, outcome,
    )  # fmt: skip
    if len(data) > MAX_LINE_BYTES:
        arguments = _summarized(arguments)
        detail = _summarized(detail)
        data = encode_line(
            now, step, session, tool, decision, reason, category, arguments, duration_ms,
            detail, event, call_id, outcome,
        )  # fmt: skip
    return data


def encode_line(
    now: datetime,
    step: Any,
    session: Any,
    tool: Any,
    decision: Any,
    reason: Any,
    category: Any,
    arguments: Any,
    duration_ms: Any,
    detail: Any,
    event: Any,
    call_id: Any,
    outcome: Any,
) -> bytes:
    """One `ActionLine` as its JSON line (newline included), without a model per line.

    Every line of every call goes through here, so the model's checks are made by
    hand (the literals, the call id's length, the types) and a plain dict of the
    already redacted values, in the model's field order, goes to the model's own
    serializer (pydantic-core's `to_json`, NaN and infinity as null as the model
    writes them): the same bytes as `ActionLine(...).model_dump_json()`, in half its
    time (building the model was most of it). A line the checks refuse goes through
    the model, which raises what it would have raised (tests/guard/test_actionlog.py
    checks every kind of line against the model)."""
    if (
        decision not in _DECISIONS
        or event not in _EVENTS
        or outcome not in _OUTCOMES
        or not (call_id is None or (type(call_id) is str and len(call_id) <= 40))
        or type(session) is not str
        or type(tool) is not str
        or type(reason) is not str
        or type(category) is not str
        or type(arguments) is not dict
        or type(detail) is not dict
        or not (duration_ms is None or type(duration_ms) is float)
        or type(step) is not str
    ):
        fields = {
            "session": session, "tool": tool, "decision": decision, "reason": reason,
            "category": category, "arguments": arguments, "duration_ms": duration_ms,
            "detail": detail, "event": event, "call_id": call_id, "outcome": outcome,
        }  # fmt: skip
        return _model_line(now, step, fields)  # the model says what is wrong
    line = {
        "time": now,
        "step": step,
        "session": session,
        "tool": tool,
        "decision": decision,
        "reason": reason,
        "category": category,
        "arguments": arguments,
        "duration_ms": duration_ms,
        "detail": detail,
        "event": event,
        "call_id": call_id,
        "outcome": outcome,
    }
    return to_json(line, inf_nan_mode="null") + b"\n"


def _model_line(now: datetime, step: str, fields: dict[str, Any]) -> bytes:
    """The line through the model itself (raises what the model raises)."""
    line = ActionLine(time=now, step=step, **{k: fields[k] for k in _FIELDS if k in fields})
    return (line.model_dump_json() + "\n").encode()
