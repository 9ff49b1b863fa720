"""What a run reads from the workflow folder before any run folder exists: the step,
its prompt, the CAs it trusts, its MCP servers' credentials, and what it is seeded from.

Everything here can fail with a ConfigError, and does so before the run leaves any
trace: a missing credential or an unreadable prompt is the caller's to fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sandbox.contracts.config import Step, Workflow, load_workflow, resolve_crew_folder
from sandbox.contracts.errors import ConfigError
from sandbox.launch.seccomp import step_profile
from sandbox.prepare.copytree import newest_real_run
from sandbox.prepare.dbcopy import find_workflow_db


@dataclass(frozen=True)
class StepInputs:
    """What the run reads from the workflow folder before any run folder exists."""

    workflow: Workflow
    step: Step
    crew: dict[str, Path]
    prompt: str | None
    mcp_host_env: dict[str, dict[str, str]]
    trusted_ca_pem: str
    seccomp_text: str


@dataclass(frozen=True)
class Seed:
    """What the step's disk starts with: the tree its group folder is a copy of (None:
    it starts empty) and the SQLite DB its DB copy is made from (None: no DB access).

    A single run seeds from the newest real run and the workflow DB; a chain step
    from what the chain's earlier steps left (see `sandbox.run.workflowrun`)."""

    group: Path | None
    db: Path | None

    @classmethod
    def from_workflow(cls, workflow_dir: Path, group: str) -> Seed:
        """The newest real run's execution tree and the real DB (look up under the lock)."""
        return cls(group=newest_real_run(workflow_dir, group), db=find_workflow_db(workflow_dir))


def read_inputs(workflow_dir: Path, step_id: str) -> StepInputs:
    """Everything read from the workflow folder; a missing credential fails here,
    before any folder exists."""
    workflow = load_workflow(workflow_dir)
    step = workflow.step(step_id)
    return StepInputs(
        workflow=workflow,
        step=step,
        crew={c.name: resolve_crew_folder(workflow_dir, c) for c in workflow.crew_folders},
        prompt=read_prompt(workflow_dir, step),
        mcp_host_env=mcp_host_env(workflow),
        trusted_ca_pem=trusted_cas(workflow_dir, workflow),
        seccomp_text=step_profile(),
    )


def mcp_host_env(workflow: Workflow) -> dict[str, dict[str, str]]:
    """Credentials for MCP servers come from the runner's environment, by name."""
    out: dict[str, dict[str, str]] = {}
    for server in workflow.mcp_servers:
        missing = [name for name in server.env_from_host if name not in os.environ]
        if missing:
            raise ConfigError(
                f"MCP server {server.name!r} needs {', '.join(missing)} in the runner's environment"
            )
        out[server.name] = {name: os.environ[name] for name in server.env_from_host}
    return out


def read_prompt(workflow_dir: Path, step: Step) -> str | None:
    """The step's prompt file, read without following a link at its end."""
    if step.prompt_file is None:
        return None
    path = workflow_dir / step.prompt_file
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise ConfigError(f"step {step.id}: prompt_file {path} unreadable: {exc}") from None


def trusted_cas(workflow_dir: Path, workflow: Workflow) -> str:
    """The CAs the workflow's egress trusts beyond the system's, as one PEM text."""
    texts = []
    for name in workflow.egress.trust_ca_files:
        path = workflow_dir / name
        try:
            texts.append(path.read_text(encoding="ascii"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"egress.trust_ca_files: {path} unreadable: {exc}") from None
    return "\n".join(texts)
