"""The step's runtime choice and what runsc needs, as data (no engine needed)."""

from __future__ import annotations

import json

import pytest

from sandbox.backends.docker import runtimes
from sandbox.contracts.config import Workflow
from sandbox.contracts.errors import ConfigError, EngineError
from sandbox.launch import firewall, runtime
from sandbox.launch.seccomp import step_profile
from sandbox.run.testrun import STEP_RUNTIME_ENV, step_runtime_for

USABLE = {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=host", "--oci-seccomp"]}}


def _workflow(step_runtime: str = "runc") -> Workflow:
    return Workflow.model_validate(
        {
            "steps": [{"id": "s", "group": "g", "command": "true"}],
            "isolation": {"step_runtime": step_runtime},
        }
    )


def test_any_source_can_add_gvisor_and_none_can_take_it_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(STEP_RUNTIME_ENV, raising=False)
    assert step_runtime_for(_workflow(), None) == "runc"
    assert step_runtime_for(_workflow(), "runsc") == "runsc"
    assert step_runtime_for(_workflow("runsc"), "runc") == "runsc"
    monkeypatch.setenv(STEP_RUNTIME_ENV, "runsc")
    assert step_runtime_for(_workflow(), "runc") == "runsc"
    monkeypatch.setenv(STEP_RUNTIME_ENV, "kata")
    with pytest.raises(ConfigError, match="expected runc or runsc"):
        step_runtime_for(_workflow(), None)


def test_an_unknown_step_runtime_in_the_workflow_is_an_error() -> None:
    with pytest.raises(ValueError, match="step_runtime"):
        _workflow("kata")


def test_runsc_profile_allows_clone3_and_keeps_every_other_rule() -> None:
    profile = step_profile()
    assert runtime.profile_for("runc", profile) == profile
    original, variant = json.loads(profile), json.loads(runtime.profile_for("runsc", profile))

    def actions(data: dict[str, object]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for rule in data["syscalls"]:  # type: ignore[attr-defined]
            for name in rule["names"]:
                out.setdefault(name, set()).add(rule["action"])
        return out

    before, after = actions(original), actions(variant)
    assert "SCMP_ACT_ERRNO" in before["clone3"] and after["clone3"] == {"SCMP_ACT_ALLOW"}
    aliases = set(runtime.SENTRY_SYSCALL_NAMES.values())
    assert {k: v for k, v in before.items() if k != "clone3"} == {
        k: v for k, v in after.items() if k not in {"clone3", *aliases}
    }
    assert variant["defaultAction"] == original["defaultAction"]


def test_runsc_profile_names_each_call_as_the_sentry_does_too() -> None:
    """gVisor's table calls 270 `pselect`: a rule naming only `pselect6` is dropped by
    runsc, `select.select` gets EPERM and the executor never answers a tool call."""
    variant = json.loads(runtime.profile_for("runsc", step_profile()))
    assert runtime.SENTRY_SYSCALL_NAMES["pselect6"] == "pselect"
    for linux_name, sentry_name in runtime.SENTRY_SYSCALL_NAMES.items():
        for rule in variant["syscalls"]:
            if linux_name in rule["names"]:
                assert sentry_name in rule["names"], rule
        assert any(linux_name in rule["names"] for rule in variant["syscalls"])


def test_runsc_gets_a_pids_floor_and_its_runtime_name() -> None:
    assert runtime.step_pids("runc", 64) == 64
    assert runtime.step_pids("runsc", 64) == runtime.PIDS_FLOOR
    assert runtime.step_pids("runsc", 1024) == 1024
    assert runtime.engine_runtime("runc") is None
    assert runtime.engine_runtime("runsc") == "runsc"


def test_runsc_must_be_registered_with_passthrough_and_oci_seccomp() -> None:
    assert runtimes.runsc_problem({"Runtimes": USABLE}) is None
    no_seccomp = {"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=host"]}}
    problem = runtimes.runsc_problem({"Runtimes": no_seccomp})
    assert problem is not None and "--oci-seccomp" in problem
    assert "no runtime named 'runsc'" in (runtimes.runsc_problem({"Runtimes": {}}) or "")
    with pytest.raises(EngineError, match=r"daemon\.json"):
        runtimes.require_runsc({"Runtimes": {"runc": {"path": "runc"}}})


def test_the_firewall_never_lets_uid_0_out() -> None:
    with pytest.raises(ValueError, match="uid 0"):
        firewall.rules(0)
    for args in firewall.rules().values():
        assert not any("--uid-owner 0 " in a or a.endswith("--uid-owner 0") for a in args)
