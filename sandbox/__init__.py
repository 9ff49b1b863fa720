"""Test-mode sandbox runner for AI-agent workflow steps.

The public surface: `execute_step` runs one step once in test mode and returns
its record; `execute_workflow` runs a whole workflow's steps as one test run and
returns its `WorkflowRunRecord`; `verify_step` runs one step once and judges its
expectations, `verify_workflow` a whole chain against a workflow's expectations
file; `gate` (`gate_workflow`) says whether the step's (the chain's) current
version has a passing verification; `compare` says what a step did differently in
two finished test runs (`RunComparison`; two whole-workflow runs step by step:
`ChainComparison`);
`workflow_run_lock` is the lock a controller takes (shared) for a normal run, so no
test run starts beside it. `__version__` is the installed distribution's version.

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

    from sandbox.contracts.errors import ConfigError, EngineError, RefusedError, SandboxError
    from sandbox.contracts.events import RunEvent
    from sandbox.contracts.record import RunStatus, TestRunRecord
    from sandbox.contracts.workflow_record import WorkflowRunRecord
    from sandbox.prepare.lock import LockHeldError, workflow_run_lock
    from sandbox.run.testrun import RunOptions, TestRun, execute_step
    from sandbox.run.workflowrun import WorkflowOptions, WorkflowRun, execute_workflow
    from sandbox.verify.chaindiff import ChainComparison
    from sandbox.verify.compare import compare
    from sandbox.verify.diff import RunComparison
    from sandbox.verify.gate import gate, gate_workflow
    from sandbox.verify.verifystep import verify_step
    from sandbox.verify.verifyworkflow import verify_workflow

_WHERE = {
    "ConfigError": "sandbox.contracts.errors",
    "EngineError": "sandbox.contracts.errors",
    "RefusedError": "sandbox.contracts.errors",
    "SandboxError": "sandbox.contracts.errors",
    "LockHeldError": "sandbox.prepare.lock",
    "workflow_run_lock": "sandbox.prepare.lock",
    "RunStatus": "sandbox.contracts.record",
    "TestRunRecord": "sandbox.contracts.record",
    "RunOptions": "sandbox.run.testrun",
    "TestRun": "sandbox.run.testrun",
    "execute_step": "sandbox.run.testrun",
    "verify_step": "sandbox.verify.verifystep",
    "gate": "sandbox.verify.gate",
    "compare": "sandbox.verify.compare",
    "RunComparison": "sandbox.verify.diff",
    "ChainComparison": "sandbox.verify.chaindiff",
    "gate_workflow": "sandbox.verify.gate",
    "verify_workflow": "sandbox.verify.verifyworkflow",
    "RunEvent": "sandbox.contracts.events",
    "WorkflowRunRecord": "sandbox.contracts.workflow_record",
    "WorkflowOptions": "sandbox.run.workflowrun",
    "WorkflowRun": "sandbox.run.workflowrun",
    "execute_workflow": "sandbox.run.workflowrun",
}

__all__ = [
    "ChainComparison",
    "ConfigError",
    "EngineError",
    "LockHeldError",
    "RefusedError",
    "RunComparison",
    "RunEvent",
    "RunOptions",
    "RunStatus",
    "SandboxError",
    "TestRun",
    "TestRunRecord",
    "WorkflowOptions",
    "WorkflowRun",
    "WorkflowRunRecord",
    "compare",
    "execute_step",
    "execute_workflow",
    "gate",
    "gate_workflow",
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
