"""The runner's own settings from its environment (`SANDBOX_*`), read into one model.

Every runner module takes these from `runner_settings()`, never from `os.environ`: one
place says which variables exist, what each means and what a bad value is. Each call
reads the environment as it is then (a process that changes a variable between runs
gets the new value, as it always did); a run reads them once, at its start.

Not here: the in-container code (`sandbox.stepside`, the guard's entry point), which
has its own environment; the engine's and the cluster's own variables (`DOCKER_*`,
`KUBECONFIG`), read where their client libraries read them; an MCP server's
credentials (`env_from_host`), which are data the workflow names. The host config's
path is read by `sandbox.contracts.hostpath` (it must load before pydantic does).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from sandbox.contracts.config import StepRuntime
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.hostpath import host_config_path

IMAGE_TAG_ENV = "SANDBOX_IMAGE_TAG"
STEP_RUNTIME_ENV = "SANDBOX_STEP_RUNTIME"
LOCK_DIR_ENV = "SANDBOX_LOCK_DIR"
DEFAULT_IMAGE_TAG = "current"


class RunnerSettings(BaseModel):
    """What the runner's environment says."""

    model_config = ConfigDict(frozen=True)

    # The tag of the run's images, so several checkouts on one engine never run each
    # other's images (`SANDBOX_IMAGE_TAG`).
    image_tag: str = DEFAULT_IMAGE_TAG
    # runsc: every step under gVisor (`SANDBOX_STEP_RUNTIME`); it can add the wall,
    # never take away one the workflow asked for. Kept as written and checked where a
    # run reads it (`step_runtime()`), so a bad value fails a run, not every command.
    step_runtime_text: str = ""
    # The host's folder of workflow locks (`SANDBOX_LOCK_DIR`); None: the default ones.
    lock_dir: Path | None = None
    # The host config file in effect (`SANDBOX_HOST_CONFIG`, else the default path
    # when it exists); None: there is none.
    host_config: Path | None = None

    def step_runtime(self) -> StepRuntime | None:
        """The step runtime asked for; None: not set. An unknown one is a ConfigError."""
        if self.step_runtime_text == "":
            return None
        if self.step_runtime_text == "runc":
            return "runc"
        if self.step_runtime_text == "runsc":
            return "runsc"
        raise ConfigError(f"{STEP_RUNTIME_ENV}={self.step_runtime_text!r}: expected runc or runsc")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RunnerSettings:
        """The settings `environ` (the process's environment by default) holds."""
        env = os.environ if environ is None else environ
        lock_dir = env.get(LOCK_DIR_ENV)
        return cls(
            image_tag=env.get(IMAGE_TAG_ENV, DEFAULT_IMAGE_TAG),
            step_runtime_text=env.get(STEP_RUNTIME_ENV, "").strip(),
            lock_dir=Path(lock_dir) if lock_dir else None,
            host_config=host_config_path(),
        )


def runner_settings() -> RunnerSettings:
    """The runner's settings as its environment holds them now."""
    return RunnerSettings.from_environ()
