"""No pydantic plugin in a process that validates the run's configs and records.

At its first model pydantic looks up every `pydantic` entry point of the installed
distributions and loads each one; a plugin then sees every validation. In the guard
that is its config, both tokens in it; in the root runner, every record. Neither has a
use for a plugin, and the look-up is CPU on every run's critical path: the runner's
start before its first container (the scan of its environment's distributions), the
guard's start before it listens (the loader's import of `importlib.metadata`, which
brings `email`, `zipfile` and `csv`, some 15 ms of CPU in the guard's image that
nothing else of the guard imports). Standard library only: called before pydantic
loads.
"""

from __future__ import annotations

import os
import sys
import types

# pydantic's own switch: `get_plugins()` returns none without looking any up.
PLUGINS_ENV = "PYDANTIC_DISABLE_PLUGINS"
PLUGINS_OFF = "__all__"
# The module pydantic's schema validators ask for plugins (`get_plugins`, its only name
# pydantic imports); it imports `importlib.metadata` as it loads.
PLUGIN_LOADER = "pydantic.plugin._loader"


def refuse_pydantic_plugins() -> None:
    """This process's pydantic loads no plugin (and the processes it starts inherit the
    switch). For a process that is a `sandbox` command or the guard: never a caller's
    own process, whose environment is its own."""
    os.environ[PLUGINS_ENV] = PLUGINS_OFF


def without_plugin_loader() -> None:
    """`refuse_pydantic_plugins`, and pydantic's plugin loader replaced by one that has
    none before pydantic loads, so `importlib.metadata` is never imported for it. For the
    guard, whose image pins pydantic (`images/constraints.txt`); a pydantic already
    loaded keeps its own loader (the switch still holds)."""
    refuse_pydantic_plugins()
    if PLUGIN_LOADER in sys.modules or "pydantic" in sys.modules:
        return
    loader = types.ModuleType(PLUGIN_LOADER, "No plugins: see sandbox.contracts.noplugins.")
    loader.get_plugins = _no_plugins  # type: ignore[attr-defined]
    sys.modules[PLUGIN_LOADER] = loader


def _no_plugins() -> tuple[()]:
    return ()
