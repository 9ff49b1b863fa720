"""Loading the step's seccomp profile (built in `sandbox/seccomp/`, see its README).

The Engine API takes the profile's JSON text, not a path. A missing or
malformed profile is an error, never a silent fall-back to the engine default.
"""

from __future__ import annotations

import json
from importlib import resources
from importlib.resources.abc import Traversable

from sandbox.contracts.errors import ConfigError

# Package data: found the same way in a checkout and in an installed wheel.
PROFILE_PATH: Traversable = resources.files("sandbox") / "seccomp" / "step.json"


def step_profile(path: Traversable = PROFILE_PATH) -> str:
    """The compact JSON text of the step profile."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"seccomp profile {path} unusable: {exc}") from None
    if not isinstance(data, dict) or "defaultAction" not in data or "syscalls" not in data:
        raise ConfigError(f"seccomp profile {path} is not a Docker seccomp profile")
    return json.dumps(data, separators=(",", ":"))
