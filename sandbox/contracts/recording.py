"""Recorded reads and replay: the match key, the guard's settings, the index line and
what the record says (recording.spec.md in sandbox/guard/ says the whole contract).

The key is computed here once, for both the guard that records and the guard that
replays, so a recording made by one version of the guard matches in the next only
when this function (and `KEY_VERSION`) did not change.
"""

from __future__ import annotations

import hashlib
import json
import re
from json.encoder import encode_basestring
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_json

from sandbox.contracts.defaults import empty_list

KEY_VERSION = 1
DEFAULT_CAP_BYTES = 64 * 1024**2  # the whole recording of one run
DEFAULT_BODY_CAP_BYTES = 16 * 1024**2  # one answer; a larger one is relayed, not kept
MAX_INDEX_BYTES = 8 * 1024**2  # the index a host reads back (about 30 000 lines)
MAX_NOT_KEPT_KEYS = 50  # keys of answers not kept, named in the record
MAX_MISSES_NAMED = 100  # replay misses named in the record (all are counted)
RECORDING_DIR = "recording"  # in the guard's folder: index.jsonl and blobs/<sha256>
REPLAY_DIR = "replay"  # in the guard's folder: the recording a replay serves from
INDEX_FILE = "index.jsonl"
BLOBS_DIR = "blobs"
SHA256 = re.compile(r"^[0-9a-f]{64}$")

Kind = Literal["egress", "mcp", "bridge"]
MissMode = Literal["stub", "live"]
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


# What `json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)` makes
# for every doc, without an encoder built per key (one a forwarded call). Reentrant:
# each `encode` keeps its own state.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# `_CANONICAL.encode` of a call's arguments (a dict parsed from JSON: no cycle, every
# value JSON's), with the C encoder `iterencode` would build for it made once rather
# than per key (its Python set-up was most of a bridge key's encoding). The same bytes
# (tests/contracts/test_recording.py). Without the C encoder: `_CANONICAL.encode`.
_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)
_ARGUMENTS_ENCODER: Any = (
    _make_encoder(
        None,  # no cycle check: parsed JSON has none
        _CANONICAL.default,
        encode_basestring,
        None,
        ":",
        ",",
        True,  # sort_keys
        False,  # skipkeys
        True,  # allow_nan
    )
    if _make_encoder is not None
    else None
)


def _canonical_arguments(arguments: dict[str, Any]) -> str:
    if _ARGUMENTS_ENCODER is None:
        return _CANONICAL.encode(arguments)
    return "".join(_ARGUMENTS_ENCODER(arguments, 0))


def key_of(kind: Kind, **parts: Any) -> str:
    """The match key: sha256 of the canonical JSON of the kind and its parts.

    egress: method, url, body_sha256; mcp: server, tool, arguments; bridge: tool,
    arguments. Canonical: sorted keys, no spaces, UTF-8 (arguments compare as JSON
    values, so key order and spacing in the step's request do not matter)."""
    doc = {"v": KEY_VERSION, "kind": kind, **parts}
    text = _CANONICAL.encode(doc)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def egress_key(method: str, url: str, body_sha256: str) -> str:
    """`key_of("egress", method=, url=, body_sha256=)`, its canonical JSON written here
    with the string encoder `json.dumps` uses for it (keys in sorted order): every
    read's key, where the general encoder was most of the cost. The same bytes
    (tests/contracts/test_recording.py pins the two equal)."""
    text = (
        f'{{"body_sha256":{encode_basestring(body_sha256)},"kind":"egress",'
        f'"method":{encode_basestring(method)},"url":{encode_basestring(url)},'
        f'"v":{KEY_VERSION}}}'
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def bridge_key_of(tool: str, arguments: dict[str, Any]) -> str:
    """`key_of("bridge", tool=, arguments=)`, the fixed part of its canonical JSON
    written here (keys in sorted order) and only the arguments through the canonical
    encoder: every forwarded bridge call's key, where encoding the whole document
    was two thirds of the key's cost. The same bytes (tests/contracts/test_recording.py
    pins the two equal)."""
    text = (
        f'{{"arguments":{_canonical_arguments(arguments)},"kind":"bridge",'
        f'"tool":{encode_basestring(tool)},"v":{KEY_VERSION}}}'
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def miss_text(what: str) -> str:
    """The answer a replay miss gets (never a real answer)."""
    return (
        f"TEST MODE: replay miss: {what} is not in the recording this run replays, "
        "so it was not sent and has no recorded answer."
    )


class RecordingSettings(BaseModel):
    """The guard's recording caps (host.toml `[recording]`, or the run's options)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Keep every allowed read's answer.")
    cap_bytes: int = Field(
        default=DEFAULT_CAP_BYTES, ge=0, description="The whole recording's size cap, in bytes."
    )
    body_cap_bytes: int = Field(
        default=DEFAULT_BODY_CAP_BYTES,
        ge=0,
        description="One answer's size cap, in bytes; a larger answer is relayed, not kept.",
    )


class ReplaySettings(BaseModel):
    """What the guard replays from: `dir` holds the source's index and blobs (copied
    by the host, checked), `miss` what an unmatched read gets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: str
    miss: MissMode = "stub"


class IndexLine(BaseModel):
    """One line of a recording's index.jsonl (written by the guard)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(pattern=SHA256.pattern)
    kind: Kind
    what: str = Field(max_length=600)  # e.g. "GET https://host/path", "mcp files/read"
    kept: bool
    bytes: int = Field(ge=0)
    sha256: str | None = Field(default=None, pattern=SHA256.pattern)
    why_not: str = ""  # "over the body cap", "over the recording cap", "cut short"
    # "hit" / "miss": a line a replaying guard writes for each read it answered
    replay: Literal["", "hit", "miss", "live"] = ""


class NotKept(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str = Field(description="The read's match key.")
    what: str = Field(description="The read, for people (`GET https://...`, `mcp srv/tool`).")
    bytes: int = Field(description="The answer's size (relayed whole all the same).")
    why: str = Field(description="Why it was not kept (a cap, cut short, a failed write).")


class RecordingSummary(BaseModel):
    """The record's account of the reads this run kept (`recording` in test_mode.json)."""

    model_config = ConfigDict(extra="forbid")

    cap_bytes: int = Field(description="The whole recording's cap.")
    body_cap_bytes: int = Field(description="One answer's cap.")
    kept: int = Field(default=0, description="Answers kept.")
    kept_bytes: int = Field(default=0, description="Their bytes (each distinct answer once).")
    not_kept: int = Field(default=0, description="Answers not kept.")
    not_kept_bytes: int = Field(default=0, description="Their bytes.")
    not_kept_named: list[NotKept] = Field(
        default_factory=empty_list, description="The first 50 answers not kept, and why."
    )
    index_sha256: str = Field(default="", description="SHA-256 of the index as read back.")
    error: str = Field(
        default="", description="Why the recording is not usable (off, or its index unreadable)."
    )


class ReplayMiss(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Kind = Field(description="egress, mcp or bridge.")
    what: str = Field(description="The read, for people.")
    key: str = Field(description="Its match key.")
    went_live: bool = Field(default=False, description="Sent to the world (misses live).")


class ReplaySummary(BaseModel):
    """The record's account of a replay (`replay` in test_mode.json): which recording,
    exactly (its run and index digest), and every read it did not have."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(description="The run whose recording answered the reads.")
    index_sha256: str = Field(description="SHA-256 of that recording's index as read.")
    miss_mode: MissMode = Field(description="What a miss got: the stub, or the world.")
    hits: int = Field(default=0, description="Reads answered from the recording.")
    misses: int = Field(default=0, description="Reads the recording did not have.")
    misses_named: list[ReplayMiss] = Field(
        default_factory=empty_list, description="The first 100 misses."
    )


# The model's own rules, read from it (one source): what `index_line_json` checks by hand.
_KINDS = frozenset(get_args(Kind))
_REPLAYS = frozenset(get_args(IndexLine.model_fields["replay"].annotation))
_MAX_WHAT: int = next(
    rule.max_length
    for rule in IndexLine.model_fields["what"].metadata
    if hasattr(rule, "max_length")
)


def index_line_json(
    *,
    key: str,
    kind: str,
    what: str,
    kept: bool,
    size: int,
    sha256: str | None = None,
    why_not: str = "",
    replay: str = "",
) -> bytes:
    """An `IndexLine`'s JSON (`json_of(IndexLine(...))`'s bytes) without a model per
    answer: when every value is one the model takes as it is (checked here as the
    model checks it), the same dict in the model's field order goes to the model's own
    serializer (pydantic-core's `to_json`); any other (non-ASCII text too) goes through
    the model, which raises what it raises (tests/contracts/test_recording.py and
    tests/guard/test_recording.py pin both)."""
    if (
        type(key) is str
        and SHA256.fullmatch(key) is not None
        and type(kind) is str
        and kind in _KINDS
        and type(what) is str
        and what.isascii()
        and len(what) <= _MAX_WHAT
        and type(kept) is bool
        and type(size) is int
        and size >= 0
        and (sha256 is None or (type(sha256) is str and SHA256.fullmatch(sha256) is not None))
        and type(why_not) is str
        and why_not.isascii()
        and type(replay) is str
        and replay in _REPLAYS
    ):
        line = {
            "key": key,
            "kind": kind,
            "what": what,
            "kept": kept,
            "bytes": size,
            "sha256": sha256,
            "why_not": why_not,
            "replay": replay,
        }
        return to_json(line)
    model = IndexLine(
        key=key,
        kind=kind,  # type: ignore[arg-type]
        what=what,
        kept=kept,
        bytes=size,
        sha256=sha256,
        why_not=why_not,
        replay=replay,  # type: ignore[arg-type]
    )
    return model.__pydantic_serializer__.to_json(model)
