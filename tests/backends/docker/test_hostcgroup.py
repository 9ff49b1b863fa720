"""Finding and reading a container's memory high-water mark on the host (no engine)."""

from __future__ import annotations

import os
from pathlib import Path

from sandbox.backends.docker.hostcgroup import PeakReader, peak_file, peak_file_of

V1 = "12:pids:/docker/abc\n7:memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/docker/abc\n"


def test_the_v1_memory_line_names_the_file(tmp_path: Path) -> None:
    got = peak_file_of(V1, tmp_path)
    assert got == tmp_path / "memory" / "docker" / "abc" / "memory.max_usage_in_bytes"


def test_the_unified_line_counts_only_on_a_pure_v2_host(tmp_path: Path) -> None:
    assert peak_file_of("0::/system.slice/docker-abc.scope\n", tmp_path) is None
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    got = peak_file_of("0::/system.slice/docker-abc.scope\n", tmp_path)
    assert got == tmp_path / "system.slice" / "docker-abc.scope" / "memory.peak"


def test_a_path_that_climbs_or_is_relative_is_never_used(tmp_path: Path) -> None:
    assert peak_file_of("7:memory:/docker/../../etc\n", tmp_path) is None
    assert peak_file_of("7:memory:docker/abc\n", tmp_path) is None
    assert peak_file_of("garbage\n", tmp_path) is None


def test_the_reader_reads_the_file_it_opened_again_and_again(tmp_path: Path) -> None:
    text = Path(f"/proc/{os.getpid()}/cgroup").read_text()
    target = peak_file_of(text, tmp_path)
    assert target is not None, text
    target.parent.mkdir(parents=True)
    target.write_text("1000\n")
    assert peak_file(os.getpid(), tmp_path) == target
    reader = PeakReader.open(os.getpid(), tmp_path)
    assert reader is not None
    try:
        assert reader.read() == 1000
        target.write_text("2000\n")
        assert reader.read() == 2000
        # A file put at the same path later is not the one it reads.
        target.unlink()
        target.write_text("9\n")
        assert reader.read() == 2000
    finally:
        reader.close()
    assert reader.read() is None


def test_no_such_process_no_reader(tmp_path: Path) -> None:
    assert PeakReader.open(2**22 + 7, tmp_path) is None
