"""One error hierarchy for everything a user of `sandbox` can act on.

Every error carries the exit code the CLI returns for it (`sandbox.contracts.exitcodes`),
so the CLI never has to guess. Messages are one line and say what to do next; no
traceback reaches the user.
"""

from __future__ import annotations

from sandbox.contracts.exitcodes import ExitCode


class SandboxError(Exception):
    """Base of every error the runner raises on purpose."""

    exit_code = ExitCode.ENVIRONMENT


class UsageError(SandboxError):
    """The command line is wrong: an unknown option, a missing or conflicting argument."""

    exit_code = ExitCode.USAGE


class ConfigError(SandboxError):
    """The workflow folder, its workflow.toml, the host's config or a named file is wrong."""

    exit_code = ExitCode.CONFIG


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

    exit_code = ExitCode.REFUSED


def internal_reason(phase: str, exc: BaseException) -> str:
    """One line for a record whose run ended on an error nobody planned for."""
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"internal error during {phase}: {type(exc).__name__}" + (f": {text}" if text else "")
