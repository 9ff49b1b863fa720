"""Test-mode sandbox runner for AI-agent workflow steps.

The public surface: `execute_step` runs one step once in test mode and returns
its record; `workflow_run_lock` is the lock a controller takes (shared) for a
normal run, so no test run starts beside it.
"""

from sandbox.errors import ConfigError, EngineError, RefusedError, SandboxError
from sandbox.lock import LockHeldError, workflow_run_lock
from sandbox.record import RunStatus, TestRunRecord
from sandbox.run import RunOptions, TestRun, execute_step

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
