"""Who is calling, bound per tool: argument paths the guard fills in, never the step.

Some tools name their caller in their own arguments (the session a model call is
billed to, the browser session a command drives, the workflow whose learnings
are read). For those tools this table names the argument paths and the run
value each one gets. The guard applies it after the policy's verdict, to the
arguments it forwards: whatever the step put at a bound path is deleted and the
guard's value written (the neighbouring system's server-side context bindings).
Every other argument passes through untouched, including a read tool's real
`run_id` or `step_id` argument and a nested key that merely shares a bound
key's name. The guard's identity envelope (`sandbox.contracts.wire.UpstreamCall`) is
separate and always the guard's own.

Pure: no I/O. The table is checked when this module loads: every tool is a row
of the effects table and no bound path lies inside another.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Final, TypeGuard

from sandbox.policy import EFFECTS_TABLE

__all__ = [
    "IDENTITY_BINDINGS",
    "Bound",
    "UnboundIdentity",
    "bind",
    "overwritten",
    "without_bound",
]


class Bound(StrEnum):
    """The run values a bound path can take (the guard's context for one call)."""

    RUN_ID = "run_id"
    SESSION = "session"
    WORKFLOW = "workflow"
    STEP = "step"
    RUN_KIND = "run_kind"


Path = tuple[str, ...]

# One line per bound path: tool, dotted argument path, the value it gets.
_BINDING_ROWS: Final[tuple[tuple[str, str, Bound], ...]] = (
    ("generate_text_llm", "session", Bound.SESSION),
    ("generate_text_llm", "metadata.run_id", Bound.RUN_ID),
    ("generate_text_llm", "metadata.run_kind", Bound.RUN_KIND),
    ("agent_browser", "session", Bound.SESSION),
    ("list_steps", "workflow", Bound.WORKFLOW),
    ("read_learnings", "workflow", Bound.WORKFLOW),
    ("read_knowledgebase", "workflow", Bound.WORKFLOW),
)


_ABSENT: Final = object()


# Types that are never a Mapping (exactly these, not subclasses): a path that meets
# one (a missing key, a JSON scalar or list, `_ABSENT`) is answered without the ABC
# check behind `isinstance(value, Mapping)`, which costs several times more.
_NEVER_MAPPINGS: Final = frozenset({type(None), str, int, float, bool, list, object})


def _is_object(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """A JSON object (a call's arguments parse to plain dicts: checked first)."""
    kind = type(value)
    return kind is dict or (kind not in _NEVER_MAPPINGS and isinstance(value, Mapping))


class UnboundIdentity(Exception):
    """The guard has no value for a bound path: the call must not run unbound."""


def _build(rows: Iterable[tuple[str, str, Bound]]) -> Mapping[str, Mapping[Path, Bound]]:
    table: dict[str, dict[Path, Bound]] = {}
    for tool, dotted, value in rows:
        if tool not in EFFECTS_TABLE:
            raise ValueError(f"identity binding for {tool!r}, which is not in the effects table")
        path = tuple(dotted.split("."))
        if not all(path):
            raise ValueError(f"identity binding {tool}:{dotted!r} has an empty key")
        paths = table.setdefault(tool, {})
        for other in paths:
            shorter, longer = sorted((path, other), key=len)
            if longer[: len(shorter)] == shorter:
                raise ValueError(f"identity bindings of {tool!r} overlap: {dotted!r}")
        paths[path] = value
    return MappingProxyType({t: MappingProxyType(p) for t, p in table.items()})


IDENTITY_BINDINGS: Final[Mapping[str, Mapping[Path, Bound]]] = _build(_BINDING_ROWS)
"""Tool name -> {argument path: run value}. A tool not here has no bound argument."""

# Each bound tool's paths as (path, value) pairs, and the top-level keys they start at.
# A call whose arguments hold none of those keys (the usual case: the step leaves the
# guard's paths alone) is bound, stripped and checked without a copy per path: nothing
# is there to remove, so binding only adds the paths, in the table's order, after the
# step's own keys (what removing and writing each path in turn gives; the paths never
# overlap, so each intermediate object along them is one the guard made).
_PATHS: Final[Mapping[str, tuple[tuple[Path, Bound], ...]]] = MappingProxyType(
    {tool: tuple(paths.items()) for tool, paths in IDENTITY_BINDINGS.items()}
)
_HEADS: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    {tool: frozenset(path[0] for path in paths) for tool, paths in IDENTITY_BINDINGS.items()}
)


def _with(node: Mapping[str, Any], path: Path, value: Any) -> dict[str, Any]:
    """A copy of `node` with `value` at `path`; only the dicts along the path are copied.
    A non-object on the way is replaced by an object (it sat where the guard writes)."""
    out = dict(node)
    key = path[0]
    if len(path) == 1:
        out[key] = value
    else:
        child = node.get(key)
        out[key] = _with(child if _is_object(child) else {}, path[1:], value)
    return out


def _without(node: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """A copy of `node` without `path` (an object the removal empties goes too)."""
    out = dict(node)
    key = path[0]
    if key not in out:
        return out
    if len(path) == 1:
        del out[key]
        return out
    child = out[key]
    if _is_object(child):
        rest = _without(child, path[1:])
        if rest or not child:
            out[key] = rest
        else:
            del out[key]
    return out


def bind(tool: str, arguments: Mapping[str, Any], context: Mapping[Bound, str]) -> dict[str, Any]:
    """The arguments to run `tool` with: every bound path holds the guard's value.

    Raises UnboundIdentity when `context` lacks a value a path needs."""
    out = dict(arguments)
    heads = _HEADS.get(tool)
    if heads is None:
        return out
    if heads.isdisjoint(out):  # none of the paths is there: each is only added
        for path, bound in _PATHS[tool]:
            if bound not in context:
                raise UnboundIdentity(f"{tool}: no {bound.value} to bind at {'.'.join(path)}")
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})  # a dict made here, by an earlier path
            node[path[-1]] = context[bound]
        return out
    for path, bound in IDENTITY_BINDINGS[tool].items():
        if bound not in context:
            raise UnboundIdentity(f"{tool}: no {bound.value} to bind at {'.'.join(path)}")
        out = _with(_without(out, path), path, context[bound])
    return out


def without_bound(tool: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments the step legitimately controls: bound paths removed (for the
    verdict and for the log line of a call that did not run)."""
    out = dict(arguments)
    heads = _HEADS.get(tool)
    if heads is None or heads.isdisjoint(out):  # nothing bound is there to remove
        return out
    for path in IDENTITY_BINDINGS[tool]:
        out = _without(out, path)
    return out


def overwritten(tool: str, arguments: Mapping[str, Any]) -> list[str]:
    """The bound paths where the step had put a value of its own (for the record)."""
    found: list[str] = []
    heads = _HEADS.get(tool)
    if heads is None or heads.isdisjoint(arguments):  # no path even begins there
        return found
    for path in IDENTITY_BINDINGS[tool]:
        node: Any = arguments
        for key in path:
            node = node.get(key, _ABSENT) if _is_object(node) else _ABSENT
        if node is not _ABSENT:
            found.append(".".join(path))
    return found
