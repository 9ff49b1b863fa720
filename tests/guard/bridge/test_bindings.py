"""The identity bindings on what a step can send: plain JSON, and any other Mapping."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandbox.guard.bridge import bindings
from sandbox.guard.bridge.bindings import Bound

CONTEXT = {
    Bound.RUN_ID: "test-x",
    Bound.SESSION: "root",
    Bound.WORKFLOW: "wf",
    Bound.STEP: "s",
    Bound.RUN_KIND: "test",
}
BOUND = {"session": "root", "metadata": {"run_id": "test-x", "run_kind": "test"}}


class Text(str):
    """A str of another type: not a Mapping, whatever its type."""


@pytest.mark.parametrize(
    "metadata",
    [None, "m", Text("m"), 3, 2.5, True, [1], MappingProxyType({"run_id": "mine"})],
)
def test_whatever_sits_on_a_bound_path_the_guard_s_values_are_bound(metadata: Any) -> None:
    given = {"prompt": "p", "session": "mine", "metadata": metadata}
    assert bindings.bind("generate_text_llm", given, CONTEXT) == {"prompt": "p", **BOUND}


def test_a_mapping_that_is_not_a_dict_is_an_object_on_the_path() -> None:
    given = {"prompt": "p", "metadata": MappingProxyType({"run_id": "mine", "tag": "t"})}
    assert bindings.without_bound("generate_text_llm", given) == {
        "prompt": "p",
        "metadata": {"tag": "t"},
    }
    assert bindings.overwritten("generate_text_llm", given) == ["metadata.run_id"]
    bound = bindings.bind("generate_text_llm", given, CONTEXT)
    assert bound["metadata"] == {"run_id": "test-x", "tag": "t", "run_kind": "test"}


@pytest.mark.parametrize("metadata", [None, "run_id", Text("run_id"), ["run_id"], 0])
def test_a_path_through_a_non_object_was_not_overwritten(metadata: Any) -> None:
    given = {"prompt": "p", "metadata": metadata}
    assert bindings.overwritten("generate_text_llm", given) == []
    assert bindings.without_bound("generate_text_llm", given) == given


def _reference_bind(tool: str, arguments: Any, context: dict[Bound, str]) -> dict[str, Any]:
    """Each bound path removed and written in turn, as the table orders them."""
    out = dict(arguments)
    for path, bound in bindings.IDENTITY_BINDINGS.get(tool, {}).items():
        out = bindings._with(bindings._without(out, path), path, context[bound])
    return out


def _reference_without(tool: str, arguments: Any) -> dict[str, Any]:
    out = dict(arguments)
    for path in bindings.IDENTITY_BINDINGS.get(tool, {}):
        out = bindings._without(out, path)
    return out


_LEAVES = st.one_of(st.none(), st.text(max_size=3), st.integers(), st.lists(st.integers()))
_INNER = st.dictionaries(st.sampled_from(["run_id", "run_kind", "tag"]), _LEAVES, max_size=3)
_ARGUMENTS = st.dictionaries(
    st.sampled_from(["prompt", "session", "metadata", "workflow", "x"]),
    st.one_of(_LEAVES, _INNER),
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(tool=st.sampled_from([*bindings.IDENTITY_BINDINGS, "no_such_tool"]), arguments=_ARGUMENTS)
def test_bound_stripped_and_overwritten_paths_are_the_per_path_walk_s_in_its_order(
    tool: str, arguments: dict[str, Any]
) -> None:
    """Arguments that hold no bound key take a shorter way: the same dicts, keys in
    the same order (the JSON forwarded and the key recorded), the step's dict untouched."""
    before = json.dumps(arguments)
    bound = bindings.bind(tool, arguments, CONTEXT)
    assert json.dumps(bound) == json.dumps(_reference_bind(tool, arguments, CONTEXT))
    own = bindings.without_bound(tool, arguments)
    assert json.dumps(own) == json.dumps(_reference_without(tool, arguments))
    assert own is not arguments and bound is not arguments
    found = bindings.overwritten(tool, arguments)
    assert found == [
        ".".join(path)
        for path in bindings.IDENTITY_BINDINGS.get(tool, {})
        if _holds(arguments, path)
    ]
    assert json.dumps(arguments) == before


def _holds(arguments: Any, path: tuple[str, ...]) -> bool:
    node = arguments
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def test_a_missing_run_value_is_refused_whether_or_not_the_step_set_the_path() -> None:
    partial: dict[Bound, str] = {b: v for b, v in CONTEXT.items() if b is not Bound.RUN_KIND}
    for arguments in ({"prompt": "p"}, {"prompt": "p", "metadata": {"run_kind": "x"}}):
        with pytest.raises(bindings.UnboundIdentity, match="no run_kind to bind"):
            bindings.bind("generate_text_llm", arguments, partial)
