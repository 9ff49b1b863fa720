"""Whether the engine can run the step under gVisor, read from `docker info`.

The run never starts a runsc step on an engine whose `runsc` runtime lacks
`--network=host` or `--oci-seccomp` (see `sandbox.launch.runtime`): without the
first the step cannot start (or reach its guard), without the second the seccomp
profile would be silently ignored. `EngineError` says how to register it.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

from sandbox.contracts.errors import EngineError
from sandbox.launch.runtime import RUNSC, RUNSC_REQUIRED_ARGS

REGISTER_HINT = (
    "install runsc (`apt-get install runsc`, or `bash scripts/ensure-runsc.sh`) and register it "
    "in /etc/docker/daemon.json as "
    + json.dumps(
        {"runtimes": {RUNSC: {"path": "/usr/bin/runsc", "runtimeArgs": list(RUNSC_REQUIRED_ARGS)}}}
    )
    + ", then reload dockerd (SIGHUP adds runtimes without a restart)"
)


def runsc_problem(info: dict[str, Any]) -> str | None:
    """None when the engine's `runsc` runtime is usable for the step; else what is wrong."""
    runtime = (info.get("Runtimes") or {}).get(RUNSC)
    if runtime is None:
        installed = "installed" if shutil.which(RUNSC) else "not installed on this host"
        return f"the engine has no runtime named {RUNSC!r} (runsc is {installed})"
    args = [str(a) for a in runtime.get("runtimeArgs") or []]
    missing = [a for a in RUNSC_REQUIRED_ARGS if a not in args]
    if missing:
        return f"the engine's {RUNSC!r} runtime lacks {' '.join(missing)} (it has {args or 'none'})"
    return None


def require_runsc(info: dict[str, Any]) -> None:
    problem = runsc_problem(info)
    if problem is not None:
        raise EngineError(f"step_runtime runsc: {problem}; {REGISTER_HINT}")
