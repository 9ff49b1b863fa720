"""The models `sandbox run` builds as it starts take no `list` as a default factory.

pydantic reads every default factory's signature when it builds a model, and a builtin
type's (`list`) is parsed from its text by the tokenizer: CPU that every new `sandbox run`
process pays before its first container (`sandbox.contracts.defaults`). Checked in a
fresh interpreter on what the run's imports built, never by timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from sandbox.contracts.defaults import empty_list

# What `sandbox run` imports on its way to its first container.
RUN_IMPORTS = (
    "sandbox.cli",
    "sandbox.cli.run",
    "sandbox.run.testrun",
    "sandbox.backends.choose",
    "sandbox.backends.docker.backend",
)

# A model as the check must catch it, defined in the check's interpreter.
WITH_LIST = """
from pydantic import BaseModel, Field

class WithList(BaseModel):
    items: list[int] = Field(default_factory=list)
"""

# Printed as JSON: `module.Model.field` of each model whose default factory is a builtin
# with a text signature.
SCAN = textwrap.dedent(
    """
    import inspect, json
    from pydantic import BaseModel

    def models(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from models(sub)

    found = []
    for model in set(models(BaseModel)):
        if model.__module__.split(".")[0] not in ("sandbox", "__main__"):
            continue
        if not model.__pydantic_complete__:
            continue  # built at its first use, not by the imports
        for name, field in model.model_fields.items():
            factory = field.default_factory
            builtin = inspect.isbuiltin(factory) or (
                isinstance(factory, type) and factory.__module__ == "builtins"
            )
            # What the tokenizer parses (`list`'s); `dict` has none and costs nothing.
            if builtin and getattr(factory, "__text_signature__", None):
                found.append(f"{model.__module__}.{model.__qualname__}.{name}")
    print(json.dumps(sorted(found)))
    """
)


def builtin_factories(modules: tuple[str, ...], define: str = "") -> list[str]:
    """`module.Model.field` of every model built in a new interpreter (after importing
    `modules` and running `define`) whose default factory is a builtin with a text
    signature; only the package's models and those `define` made."""
    imports = "".join(f"import {name}\n" for name in modules)
    code = imports + textwrap.dedent(define) + SCAN
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    found: list[str] = json.loads(done.stdout)
    return found


def test_the_models_a_run_builds_at_its_start_have_no_builtin_default_factory() -> None:
    assert builtin_factories(RUN_IMPORTS) == []


def test_the_check_sees_a_builtin_default_factory() -> None:
    assert builtin_factories((), WITH_LIST) == ["__main__.WithList.items"]


def test_empty_list_gives_each_model_its_own_list() -> None:
    first, second = empty_list(), empty_list()
    first.append(1)
    assert second == []
