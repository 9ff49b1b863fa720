"""One error hierarchy for everything a user of `sandbox` can act on.

Every error carries the exit code the CLI returns for it, so the CLI never has
to guess: 2 for usage, configuration and environment problems, 3 for a refusal
(the workflow is busy, or the run was refused by policy). Messages are one line
and say what to do next; no traceback reaches the user.
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base of every error the runner raises on purpose."""

    exit_code = 2


class ConfigError(SandboxError):
    """The workflow folder, its workflow.toml or a CLI argument is wrong."""


class EngineError(SandboxError):
    """The Docker engine cannot be reached or refused an operation."""


class ImageMissingError(EngineError):
    """The step or guard image has not been built on this host."""


class PrepareError(SandboxError):
    """The test run folder could not be prepared (copy, DB copy, permissions)."""


class LaunchError(SandboxError):
    """The run's containers, firewall or guard could not be brought up."""


class RefusedError(SandboxError):
    """The test run may not start now (the workflow is busy, or policy refuses it)."""

    exit_code = 3


def internal_reason(phase: str, exc: BaseException) -> str:
    """One line for a record whose run ended on an error nobody planned for."""
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"internal error during {phase}: {type(exc).__name__}" + (f": {text}" if text else "")
