"""The record's stubbed list: every stubbed call, grouped by tool, never cut silently.

A group is one tool (one egress host for `http`) with its exact count, the first and
last call's action-log line and argument digest. Every stubbed call lands in a group,
so a tool is listed however many calls came before it. Only a hostile step can make
the list long (a new tool name per call), so it is capped: tools of the effects table
(a few dozen names) are never cut; of the others the first `MAX_OTHER_GROUPS // 2`
and the last as many to appear are kept, so a flood of made-up names before or after
a real effect cannot push it out alone. What is cut is counted (`StubbedCut`).
A chain's list merges its steps' groups exactly, naming each group's steps.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from sandbox.contracts.record import StubbedAction, StubbedCut
from sandbox.contracts.wire import ActionLine
from sandbox.contracts.workflow_record import ChainStubbedAction

MAX_OTHER_GROUPS = 400
_Group = TypeVar("_Group", bound=StubbedAction)


def args_digest(arguments: dict[str, Any]) -> str:
    """A short digest of a call's arguments as the log holds them (canonical JSON)."""
    text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _key(line: ActionLine) -> tuple[str, str]:
    host = str(line.detail.get("host", "")) if line.tool == "http" else ""
    return line.tool, host


@dataclass
class _Open:
    first: ActionLine
    first_line: int
    last: ActionLine
    last_line: int
    count: int = 1


class StubGrouper:
    """Feeds on the log's stub lines in order; `result()` gives the list and the cut."""

    def __init__(self, detail: Callable[[ActionLine], str]) -> None:
        self._detail = detail  # the short hint of what a call would have done
        self._groups: dict[tuple[str, str], _Open] = {}

    def add(self, lineno: int, line: ActionLine) -> None:
        group = self._groups.get(_key(line))
        if group is None:
            self._groups[_key(line)] = _Open(line, lineno, line, lineno)
            return
        group.count += 1
        group.last, group.last_line = line, lineno

    def result(self) -> tuple[list[StubbedAction], StubbedCut]:
        out = [
            StubbedAction(
                tool=g.first.tool,
                reason=g.first.reason,
                detail=self._detail(g.first),
                host=host,
                category=g.first.category,
                count=g.count,
                first_line=g.first_line,
                last_line=g.last_line,
                first_args=args_digest(g.first.arguments),
                last_args=args_digest(g.last.arguments),
                last_detail=self._detail(g.last),
            )
            for (_, host), g in self._groups.items()
        ]
        return cap(out)


def cap(groups: list[_Group], cut: StubbedCut | None = None) -> tuple[list[_Group], StubbedCut]:
    """At most `MAX_OTHER_GROUPS` groups of tools outside the effects table (the first
    and the last half, in the order given); the table's tools are all kept."""
    from sandbox.policy import EFFECTS_TABLE  # only a hostile log's list needs it

    cut = cut.model_copy() if cut is not None else StubbedCut()
    if len(groups) <= MAX_OTHER_GROUPS:
        return groups, cut
    others = [i for i, g in enumerate(groups) if g.tool not in EFFECTS_TABLE]
    if len(others) <= MAX_OTHER_GROUPS:
        return groups, cut
    half = MAX_OTHER_GROUPS // 2
    dropped = set(others[half : len(others) - half])
    cut.groups += len(dropped)
    cut.calls += sum(groups[i].count for i in dropped)
    return [g for i, g in enumerate(groups) if i not in dropped], cut


def merge(
    steps: Iterable[tuple[str, list[StubbedAction], StubbedCut]],
) -> tuple[list[ChainStubbedAction], StubbedCut]:
    """A chain's list: each tool's groups across its steps as one, counts summed (and
    per step in `steps`), the first call from the first step that made one and the
    last from the last. The steps' own cuts add up; the merged list is capped like a
    step's."""
    merged: dict[tuple[str, str], ChainStubbedAction] = {}
    cut = StubbedCut()
    for step_id, groups, step_cut in steps:
        cut.groups += step_cut.groups
        cut.calls += step_cut.calls
        for g in groups:
            have = merged.get((g.tool, g.host))
            if have is None:
                merged[(g.tool, g.host)] = ChainStubbedAction(
                    **g.model_dump(),
                    step_id=step_id,
                    last_step_id=step_id,
                    steps={step_id: g.count},
                )
                continue
            have.count += g.count
            have.steps[step_id] = have.steps.get(step_id, 0) + g.count
            have.last_step_id = step_id
            have.last_line, have.last_args, have.last_detail = (
                g.last_line,
                g.last_args,
                g.last_detail,
            )
    return cap(list(merged.values()), cut)
