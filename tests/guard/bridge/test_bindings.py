"""The identity bindings on what a step can send: plain JSON, and any other Mapping."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest

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
