"""Which host folders a step sees, and how: the filesystem half of the sandbox.

The step gets exactly three writable folders (its group folder, the DB copy's
folder and its /tmp), all folders of the run's own disk (`sandbox.stepfs.disk`: its size
is the quota, mounted `nosuid,nodev`, so every bind of it is too); the workflow
folder (the run's view of it, without `db/` or any `runs/test-*`) and every Crew
folder are read-only; the run root with the record and the action log is never
mounted into the step.
"""

from __future__ import annotations

from pathlib import Path

from sandbox.contracts.layout import (
    C_CA_BUNDLE,
    C_CREW,
    C_DB_DIR,
    C_PROMPT,
    C_TMP,
    C_WORKFLOW,
    RunLayout,
)
from sandbox.contracts.spec import Mount


def workflow_mounts(layout: RunLayout) -> list[Mount]:
    """The workflow folder at /workflow, read-only: the one view of it that every
    container of a run gets (the step, and anything else that reads the workflow).

    It is the run's view (`sandbox.stepfs.view`, mounted by the runner before any
    container starts): the real folder without `db/` and without any `runs/test-*`."""
    return [Mount(source=str(layout.workflow_view), target=C_WORKFLOW, read_only=True)]


def step_mounts(
    layout: RunLayout,
    crew_folders: dict[str, Path],
    *,
    has_db: bool,
    has_prompt: bool,
    has_ca_bundle: bool = False,
) -> list[Mount]:
    mounts = [
        *workflow_mounts(layout),
        Mount(source=str(layout.disk_group), target=layout.container_workdir, read_only=False),
        Mount(source=str(layout.disk_tmp), target=C_TMP, read_only=False),
    ]
    if has_db:
        mounts.append(Mount(source=str(layout.disk_db), target=C_DB_DIR, read_only=False))
    if has_prompt:
        mounts.append(Mount(source=str(layout.prompt), target=C_PROMPT, read_only=True))
    if has_ca_bundle:
        mounts.append(Mount(source=str(layout.ca_bundle), target=C_CA_BUNDLE, read_only=True))
    mounts.extend(
        Mount(source=str(path), target=f"{C_CREW}/{name}", read_only=True)
        for name, path in sorted(crew_folders.items())
    )
    return mounts
