"""Test-mode sandbox runner for AI-agent workflow steps.

The public surface: `execute_step` runs one step once in test mode and returns
its record; `execute_workflow` runs a whole workflow's steps as one test run and
returns its `WorkflowRunRecord`; `start_step` and `start_workflow` start the same
runs in the background and return a `RunHandle` (events as they happen, cancel from
any thread, wait for the record); `verify_step` runs one step once and judges its
expectations, `verify_workflow` a whole chain against a workflow's expectations
file; `gate` (`gate_workflow`) says whether the step's (the chain's) current
version has a passing verification; `compare` says what a step did differently in
two finished test runs (`RunComparison`);
`workflow_run_lock` is the lock a controller takes (shared) for a normal run, so no
test run starts beside it. `__version__` is the installed distribution's version.
The result types, the error hierarchy (`SandboxError` and below) and `ExitCode`, the
`sandbox` command's exit codes, are exported with them; `__all__` is the whole
public API (a test pins it).

Names are imported on first use (PEP 562): the guard, which imports
`sandbox.guard`, must not pay for the runner's Docker client and psutil at
every start.
"""

from __future__ import annotations

import importlib

# Not `typing.TYPE_CHECKING`: the guard imports this package before it binds its ports
# (the step waits for them), and `typing` is ~10 ms of that.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    __version__: str

    from sandbox.contracts.errors import (
        ConfigError,
        EngineError,
        ImageMissingError,
        LaunchError,
        PrepareError,
        RefusedError,
        SandboxError,
        UsageError,
    )
    from sandbox.contracts.events import RunEvent
    from sandbox.contracts.exitcodes import ExitCode
    from sandbox.contracts.options import RunOptions
    from sandbox.contracts.record import RunStatus, TestRunRecord
    from sandbox.contracts.workflow_record import WorkflowRunRecord
    from sandbox.prepare.lock import LockHeldError, workflow_run_lock
    from sandbox.run.handle import RunHandle, start_step, start_workflow
    from sandbox.run.testrun import TestRun, execute_step
    from sandbox.run.workflowrun import WorkflowOptions, WorkflowRun, execute_workflow
    from sandbox.verify.chaindiff import ChainComparison
    from sandbox.verify.compare import compare
    from sandbox.verify.diff import RunComparison
    from sandbox.verify.gate import GateResult, gate, gate_workflow
    from sandbox.verify.verification import Verification
    from sandbox.verify.verifystep import verify_step
    from sandbox.verify.verifyworkflow import verify_workflow
    from sandbox.verify.workflow_verification import WorkflowVerification

_WHERE = {
    "SandboxError": "sandbox.contracts.errors",
    "UsageError": "sandbox.contracts.errors",
    "ConfigError": "sandbox.contracts.errors",
    "EngineError": "sandbox.contracts.errors",
    "ImageMissingError": "sandbox.contracts.errors",
    "PrepareError": "sandbox.contracts.errors",
    "LaunchError": "sandbox.contracts.errors",
    "RefusedError": "sandbox.contracts.errors",
    "LockHeldError": "sandbox.prepare.lock",
    "workflow_run_lock": "sandbox.prepare.lock",
    "ExitCode": "sandbox.contracts.exitcodes",
    "RunStatus": "sandbox.contracts.record",
    "TestRunRecord": "sandbox.contracts.record",
    "WorkflowRunRecord": "sandbox.contracts.workflow_record",
    "RunEvent": "sandbox.contracts.events",
    "RunOptions": "sandbox.contracts.options",
    "TestRun": "sandbox.run.testrun",
    "execute_step": "sandbox.run.testrun",
    "WorkflowOptions": "sandbox.run.workflowrun",
    "WorkflowRun": "sandbox.run.workflowrun",
    "execute_workflow": "sandbox.run.workflowrun",
    "RunHandle": "sandbox.run.handle",
    "start_step": "sandbox.run.handle",
    "start_workflow": "sandbox.run.handle",
    "Verification": "sandbox.verify.verification",
    "WorkflowVerification": "sandbox.verify.workflow_verification",
    "verify_step": "sandbox.verify.verifystep",
    "verify_workflow": "sandbox.verify.verifyworkflow",
    "GateResult": "sandbox.verify.gate",
    "gate": "sandbox.verify.gate",
    "gate_workflow": "sandbox.verify.gate",
    "RunComparison": "sandbox.verify.diff",
    "ChainComparison": "sandbox.verify.chaindiff",
    "compare": "sandbox.verify.compare",
}

__all__ = [
    "ChainComparison",
    "ConfigError",
    "EngineError",
    "ExitCode",
    "GateResult",
    "ImageMissingError",
    "LaunchError",
    "LockHeldError",
    "PrepareError",
    "RefusedError",
    "RunComparison",
    "RunEvent",
    "RunHandle",
    "RunOptions",
    "RunStatus",
    "SandboxError",
    "TestRun",
    "TestRunRecord",
    "UsageError",
    "Verification",
    "WorkflowOptions",
    "WorkflowRun",
    "WorkflowRunRecord",
    "WorkflowVerification",
    "__version__",
    "compare",
    "execute_step",
    "execute_workflow",
    "gate",
    "gate_workflow",
    "start_step",
    "start_workflow",
    "verify_step",
    "verify_workflow",
    "workflow_run_lock",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from sandbox.contracts.version import runner_version

        return runner_version()
    if name not in _WHERE:
        raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
