"""The runner's SANDBOX_* settings: each variable's meaning, read from one model."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.contracts.errors import ConfigError
from sandbox.contracts.settings import RunnerSettings


def test_without_variables_the_defaults_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sandbox.contracts.hostpath.DEFAULT_PATH", Path("/nonexistent/host.toml"))
    settings = RunnerSettings.from_environ({})
    assert settings.image_tag == "current"
    assert settings.step_runtime() is None
    assert settings.lock_dir is None
    assert settings.host_config is None


def test_each_variable_sets_its_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_HOST_CONFIG", str(tmp_path / "host.toml"))
    settings = RunnerSettings.from_environ(
        {
            "SANDBOX_IMAGE_TAG": "ci-7",
            "SANDBOX_STEP_RUNTIME": " runsc ",
            "SANDBOX_LOCK_DIR": str(tmp_path / "locks"),
        }
    )
    assert settings.image_tag == "ci-7"
    assert settings.step_runtime() == "runsc"
    assert settings.lock_dir == tmp_path / "locks"
    assert settings.host_config == tmp_path / "host.toml"


def test_an_unknown_step_runtime_fails_the_run_that_reads_it_only() -> None:
    # Read without error (a command that runs no step must not fail on it) ...
    settings = RunnerSettings.from_environ({"SANDBOX_STEP_RUNTIME": "kata"})
    # ... and refused, naming the variable, where a run asks for the runtime.
    with pytest.raises(ConfigError, match="SANDBOX_STEP_RUNTIME='kata': expected runc or runsc"):
        settings.step_runtime()


def test_the_runner_reads_no_sandbox_variable_outside_the_settings() -> None:
    package = Path(__file__).parents[2] / "sandbox"
    allowed = {
        package / "contracts" / "settings.py",
        package / "contracts" / "hostpath.py",  # loads before pydantic (see its docstring)
    }
    in_container = (package / "stepside", package / "guard")
    readers = [
        path
        for path in package.rglob("*.py")
        if path not in allowed
        and not path.is_relative_to(in_container[0])
        and not path.is_relative_to(in_container[1])
        and ('environ.get("SANDBOX_' in path.read_text() or 'getenv("SANDBOX_' in path.read_text())
    ]
    assert readers == []
