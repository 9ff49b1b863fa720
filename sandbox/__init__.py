"""Test-mode sandbox runner for AI-agent workflow steps.

The public surface: `execute_step` runs one step once in test mode and returns
its record; `workflow_run_lock` is the lock a controller takes (shared) for a
normal run, so no test run starts beside it.

Names are imported on first use (PEP 562): the guard, which imports
`sandbox.guard`, must not pay for the runner's Docker client and psutil at
every start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandbox.errors import ConfigError, EngineError, RefusedError, SandboxError
    from sandbox.lock import LockHeldError, workflow_run_lock
    from sandbox.record import RunStatus, TestRunRecord
    from sandbox.run import RunOptions, TestRun, execute_step

_WHERE = {
    "ConfigError": "sandbox.errors",
    "EngineError": "sandbox.errors",
    "RefusedError": "sandbox.errors",
    "SandboxError": "sandbox.errors",
    "LockHeldError": "sandbox.lock",
    "workflow_run_lock": "sandbox.lock",
    "RunStatus": "sandbox.record",
    "TestRunRecord": "sandbox.record",
    "RunOptions": "sandbox.run",
    "TestRun": "sandbox.run",
    "execute_step": "sandbox.run",
}

__all__ = [
    "ConfigError",
    "EngineError",
    "LockHeldError",
    "RefusedError",
    "RunOptions",
    "RunStatus",
    "SandboxError",
    "TestRun",
    "TestRunRecord",
    "execute_step",
    "workflow_run_lock",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
