"""Which host folders a step sees, and how: the filesystem half of the sandbox.

The step gets exactly two writable folders (its group folder and the DB copy's
folder, both inside its own test run); the real workflow folder and every Crew
folder are read-only; the run root with the record and the action log is never
mounted writable. The real `db/` is only ever seen through the read-only
workflow mount.
"""

from __future__ import annotations

from pathlib import Path

from sandbox.layout import C_CA_BUNDLE, C_CREW, C_DB_DIR, C_PROMPT, C_WORKFLOW, RunLayout
from sandbox.spec import Mount


def workflow_mounts(layout: RunLayout) -> list[Mount]:
    """The real workflow folder at /workflow, read-only: the one view of it that every
    container of a run gets (the step, and anything else that reads the workflow)."""
    return [Mount(source=str(layout.workflow_dir), target=C_WORKFLOW, read_only=True)]


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
        Mount(source=str(layout.group_dir), target=layout.container_workdir, read_only=False),
    ]
    if has_db:
        mounts.append(Mount(source=str(layout.db_dir), target=C_DB_DIR, read_only=False))
    if has_prompt:
        mounts.append(Mount(source=str(layout.prompt), target=C_PROMPT, read_only=True))
    if has_ca_bundle:
        mounts.append(Mount(source=str(layout.ca_bundle), target=C_CA_BUNDLE, read_only=True))
    mounts.extend(
        Mount(source=str(path), target=f"{C_CREW}/{name}", read_only=True)
        for name, path in sorted(crew_folders.items())
    )
    return mounts
