"""The host file systems of one test run, from prepare to record: the step's disk and its view.

`StepFs.open()` mounts the run's view of the workflow folder (`sandbox.stepfs.view`)
and makes the step's disk (`sandbox.stepfs.disk`); the run copies the real execution tree and
the DB copy onto the disk, snapshots the group folder, and launches. After the step
stopped, `collect()` takes the disk's figures and the group folder's changes, and
copies the group folder and the DB copy off the disk into the run folder
(`runs/test-<id>/<group>/`, `runs/test-<id>/db/`), where the record and its readers
find them. `close()` (on every way out, after the containers are gone) unmounts both
and deletes the image. The seam for a workflow chain: keep one `StepFs` open across
the chain's steps and collect once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandbox.collect import watch
from sandbox.contracts.layout import RunLayout, make_private_dir
from sandbox.contracts.record import FileChanges
from sandbox.contracts.reports import CopyReport
from sandbox.hostfs import fdtree
from sandbox.stepfs import view
from sandbox.stepfs.disk import DiskUsage, DiskWatch, StepDisk


@dataclass
class Collected:
    used_bytes: int
    peak_bytes: int
    full: bool
    files: FileChanges
    export: CopyReport


class StepFs:
    def __init__(self, layout: RunLayout, quota_bytes: int) -> None:
        self.layout = layout
        self.quota_bytes = quota_bytes
        self.disk: StepDisk | None = None
        self._watch: DiskWatch | None = None
        self._files = watch.FolderWatch(layout.disk_group)
        self.collected = False

    def open(self) -> StepDisk:
        """Mount the view and make the disk (PrepareError, nothing left, if it cannot)."""
        try:
            view.mount_view(self.layout)
            self.disk = StepDisk.create(self.layout, self.quota_bytes)
        except BaseException:
            self.close()
            raise
        return self.disk

    def snapshot_before(self) -> None:
        """The group folder as the step gets it (call once its copy is in)."""
        self._files.start()

    def watch(self, on_full: Callable[[DiskUsage], None]) -> None:
        """Stop the step (``on_full``) as soon as its disk is full."""
        assert self.disk is not None
        self._watch = DiskWatch(self.disk, on_full)
        self._watch.start()

    @property
    def full(self) -> bool:
        return self._watch is not None and self._watch.full

    def collect(self, *, has_db: bool) -> Collected:
        """Call after the step stopped: the figures, the changes, the copy off the disk."""
        assert self.disk is not None
        self.collected = True
        if self._watch is None:
            self._watch = DiskWatch(self.disk, lambda _usage: None)
        used = self._watch.stop()
        files = self._files.changes()
        make_private_dir(self.layout.group_dir)
        db_dest = None
        if has_db:
            make_private_dir(self.layout.db_dir)
            db_dest = self.layout.db_dir
        export = self.disk.export(self.layout.group_dir, db_dest)
        return Collected(used, self._watch.peak_bytes, self._watch.full, files, export)

    def close(self) -> None:
        """Unmount the disk and the view; safe at any point, and twice."""
        if self._watch is not None:
            with contextlib.suppress(Exception):
                self._watch.stop()
        if self.disk is not None:
            self.disk.close()
        else:
            StepDisk(self.layout, self.quota_bytes).close()
        view.unmount_view(self.layout)


def discard(paths: list[Path]) -> list[str]:
    """Delete what a failed prepare made (fd-based, any depth); what could not go."""
    problems: list[str] = []
    for path in paths:
        problems += fdtree.remove_tree(path)
    return problems
