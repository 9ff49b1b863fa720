"""The public API is `sandbox.__all__`, pinned: adding, renaming or dropping a name is a
decision a reviewer sees here (as httpx pins its own), and every name it lists is
importable and says it comes from `sandbox`'s own modules."""

from __future__ import annotations

import inspect

import pytest

import sandbox

# The public API by concern; `__all__` is exactly these names.
RUNS = (
    "execute_step execute_workflow start_step start_workflow RunHandle TestRun WorkflowRun "
    "workflow_run_lock"
)
OPTIONS = "RunOptions WorkflowOptions"
VERDICTS = "verify_step verify_workflow gate gate_workflow compare"
RESULTS = (
    "TestRunRecord WorkflowRunRecord RunStatus RunEvent Verification WorkflowVerification "
    "GateResult RunComparison ChainComparison"
)
ERRORS = (
    "SandboxError UsageError ConfigError EngineError ImageMissingError PrepareError "
    "LaunchError RefusedError LockHeldError ExitCode"
)
PUBLIC = sorted(f"{RUNS} {OPTIONS} {VERDICTS} {RESULTS} {ERRORS} __version__".split())


def test_all_is_the_pinned_public_api() -> None:
    assert sorted(sandbox.__all__) == PUBLIC
    assert len(set(sandbox.__all__)) == len(sandbox.__all__)


def test_every_exported_member_resolves_to_sandbox_code() -> None:
    for name in sandbox.__all__:
        member = getattr(sandbox, name)
        if name == "__version__":
            assert isinstance(member, str) and member
            continue
        module = inspect.getmodule(member)
        assert module is not None and module.__name__.startswith("sandbox."), name
        assert member.__name__ == name
        assert name in dir(sandbox)


def test_the_error_hierarchy_is_one_and_carries_exit_codes() -> None:
    errors = [n for n in sandbox.__all__ if n.endswith("Error")]
    for name in errors:
        error = getattr(sandbox, name)
        assert issubclass(error, sandbox.SandboxError), name
        assert isinstance(error.exit_code, sandbox.ExitCode), name
    assert issubclass(sandbox.LockHeldError, sandbox.RefusedError)
    assert sandbox.RefusedError.exit_code is sandbox.ExitCode.REFUSED


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_member"):
        sandbox.no_such_member  # noqa: B018


def test_run_options_has_no_knob_that_turns_a_wall_off() -> None:
    """The knobs that weaken a run exist for the project's own tests only
    (`sandbox.contracts.testknobs`), never on the options a caller passes."""
    fields = {f for f in sandbox.RunOptions.__dataclass_fields__}
    assert "install_firewall" not in fields
    assert not {f for f in fields if "firewall" in f or "seccomp" in f or "landlock" in f}
