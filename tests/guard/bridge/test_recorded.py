"""The recording's key of a forwarded bridge call."""

from __future__ import annotations

from sandbox.contracts.recording import key_of
from sandbox.guard.bridge import bindings
from sandbox.guard.bridge.recorded import bridge_key, own_key


def test_the_key_from_the_step_s_own_arguments_is_the_key_of_the_call() -> None:
    given = {
        "prompt": "p",
        "session": "the step's",
        "metadata": {"run_id": "the step's", "note": "kept"},
    }
    own = bindings.without_bound("generate_text_llm", given)
    key = bridge_key("generate_text_llm", given)
    assert own_key("generate_text_llm", own) == key
    # the bound paths are left out: they name the run, not the question
    expected = key_of(
        "bridge", tool="generate_text_llm", arguments={"prompt": "p", "metadata": {"note": "kept"}}
    )
    assert key == expected
    bound = bindings.bind("generate_text_llm", given, {b: "guard's" for b in bindings.Bound})
    assert bridge_key("generate_text_llm", bound) == key
