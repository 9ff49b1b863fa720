"""The group folder's snapshot: a change is judged by content, not by size and mtime."""

from __future__ import annotations

import os
from pathlib import Path

from sandbox.collect.watch import FolderWatch


def test_same_size_rewrite_with_time_set_back_is_changed(tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_bytes(b"A" * 4096)
    (tmp_path / "same.txt").write_bytes(b"kept")
    watch = FolderWatch(tmp_path)
    watch.start()
    st = data.stat()
    with data.open("r+b") as handle:
        handle.write(b"B" * 4096)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    same = tmp_path / "same.txt"
    kept = same.stat()
    same.write_bytes(b"kept")  # the same bytes again, its time set back: no change
    os.utime(same, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    changes = watch.changes()
    assert changes.changed == ["data.txt"]
    assert changes.created == [] and changes.deleted == []


def test_mode_and_link_target_changes_are_changes(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text("echo")
    os.symlink("a", tmp_path / "link")
    watch = FolderWatch(tmp_path)
    watch.start()
    st = (tmp_path / "run.sh").stat()
    os.chmod(tmp_path / "run.sh", 0o755)
    os.utime(tmp_path / "run.sh", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.unlink(tmp_path / "link")
    os.symlink("b", tmp_path / "link")
    assert watch.changes().changed == ["link", "run.sh"]


def test_a_sparse_file_is_hashed_by_its_data_not_its_apparent_size(tmp_path: Path) -> None:
    big = tmp_path / "sparse"
    with big.open("wb") as handle:
        handle.truncate(1 << 40)  # a TiB of hole: reading it whole would never end
        handle.seek(1 << 30)
        handle.write(b"x")
    watch = FolderWatch(tmp_path)
    watch.start()
    st = big.stat()
    with big.open("r+b") as handle:
        handle.seek(1 << 30)
        handle.write(b"y")
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert watch.changes().changed == ["sparse"]
