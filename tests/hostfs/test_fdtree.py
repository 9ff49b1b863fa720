"""Host-side walks and deletes of step-made trees: any depth, odd names, no permissions,
links never followed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sandbox.hostfs import fdtree
from sandbox.hostfs.fdcopy import copy_fd


def _chain(root: Path, depth: int) -> None:
    fd = os.open(root, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(os.open("leaf", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
    os.close(fd)


def test_a_chain_deeper_than_the_recursion_limit_is_walked_and_deleted(tmp_path: Path) -> None:
    root = tmp_path / "r"
    root.mkdir()
    depth = sys.getrecursionlimit() + 500
    _chain(root, depth)
    fd = fdtree.open_root(root)
    try:
        entries = list(fdtree.walk(fd))
    finally:
        os.close(fd)
    assert len(entries) == depth + 1 and entries[-1].parts == ("d",) * depth + ("leaf",)
    assert fdtree.remove_tree(root) == [] and not root.exists()


def test_links_are_entries_never_followed_and_the_entry_cap_holds(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    root = tmp_path / "r"
    (root / "a").mkdir(parents=True)
    (root / "a" / "to-outside").symlink_to(outside)
    (root / "b").symlink_to(outside)
    fd = fdtree.open_root(root)
    try:
        names = [e.parts for e in fdtree.walk(fd)]
        stats = fdtree.WalkStats()
        capped = [e.parts for e in fdtree.walk(fd, max_entries=2, stats=stats)]
    finally:
        os.close(fd)
    assert names == [("a",), ("a", "to-outside"), ("b",)]
    assert capped == [("a",), ("a", "to-outside")] and stats.capped
    assert fdtree.remove_tree(root) == []
    assert (outside / "secret").read_text() == "s"


def test_odd_names_and_folders_without_permissions_are_deleted(tmp_path: Path) -> None:
    root = tmp_path / "r"
    root.mkdir()
    odd = os.fsencode(root) + b"/odd\n\x1b[31m\xff"
    os.mkdir(odd)
    os.mkdir(odd + b"/inner")
    (root / "locked").mkdir()
    (root / "locked" / "f").write_text("x")
    (root / "locked").chmod(0)
    os.mkfifo(root / "fifo")
    assert fdtree.remove_tree(root) == [] and not root.exists()


def test_a_sparse_copy_keeps_its_holes(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    with src.open("wb") as handle:
        handle.truncate(1 << 30)
        handle.seek(1 << 29)
        handle.write(b"data")
    s = os.open(src, os.O_RDONLY)
    d = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        copy_fd(s, d)
    finally:
        os.close(s)
        os.close(d)
    assert dst.stat().st_size == 1 << 30
    assert dst.stat().st_blocks * 512 < 1024 * 1024
    with dst.open("rb") as handle:
        handle.seek(1 << 29)
        assert handle.read(4) == b"data"
