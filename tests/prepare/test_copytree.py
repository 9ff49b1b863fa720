"""copy_execution_tree / newest_real_run on real files (no mocks)."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from sandbox.contracts.reports import CopyReport, LeftOut
from sandbox.prepare.copytree import copy_execution_tree, newest_real_run

KB = 1024


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def _copy(src: Path, tmp_path: Path, **kw: int) -> tuple[Path, CopyReport]:
    dst = tmp_path / "dst"
    dst.mkdir()
    return dst, copy_execution_tree(src, dst, **kw)


def test_regular_files_dirs_modes_and_mtimes(tmp_path: Path) -> None:
    src = tmp_path / "execution"
    _write(src / "a.txt", b"alpha", 0o640)
    _write(src / "run.sh", b"#!/bin/sh\n", 0o755)
    _write(src / "suid", b"x", 0o4755 | 0o2000)
    _write(src / "sub" / "deep" / "b.bin", bytes(range(256)) * 10)
    _write(src / "empty", b"")
    os.chmod(src / "sub", 0o750)
    os.utime(src / "a.txt", ns=(1_000_000_000, 1_234_567_891_000))
    os.utime(src / "sub", ns=(1_000_000_000, 1_500_000_000_000))

    dst, rep = _copy(src, tmp_path)

    assert not rep.errors and not rep.left_out and not rep.source_missing
    assert rep.files_copied == 5 and rep.dirs_created == 2
    assert rep.bytes_copied == 5 + 10 + 1 + 2560
    assert (dst / "a.txt").read_bytes() == b"alpha"
    assert (dst / "sub/deep/b.bin").read_bytes() == bytes(range(256)) * 10
    assert (dst / "empty").read_bytes() == b""
    assert stat.S_IMODE(os.lstat(dst / "a.txt").st_mode) == 0o640
    assert stat.S_IMODE(os.lstat(dst / "run.sh").st_mode) == 0o755
    assert stat.S_IMODE(os.lstat(dst / "suid").st_mode) == 0o755  # setuid/setgid stripped
    assert stat.S_IMODE(os.lstat(dst / "sub").st_mode) == 0o750
    assert os.lstat(dst / "a.txt").st_mtime_ns == 1_234_567_891_000
    assert os.lstat(dst / "sub").st_mtime_ns == 1_500_000_000_000


def test_symlinks_copied_as_links_and_never_followed(tmp_path: Path) -> None:
    src = tmp_path / "execution"
    _write(src / "real.txt", b"in tree")
    secret = _write(tmp_path / "outside" / "secret.txt", b"S" * 5000, 0o000)
    (src / "passwd").symlink_to("/etc/passwd")
    (src / "secret").symlink_to(secret)
    (src / "rel").symlink_to("real.txt")
    (src / "dangling").symlink_to("../../nowhere")
    (src / "dirlink").symlink_to(tmp_path / "outside")  # a link to a dir is not descended

    dst, rep = _copy(src, tmp_path)

    assert not rep.errors
    assert {(s.path, s.target) for s in rep.symlinks} == {
        ("dangling", "../../nowhere"),
        ("dirlink", str(tmp_path / "outside")),
        ("passwd", "/etc/passwd"),
        ("rel", "real.txt"),
        ("secret", str(secret)),
    }
    for name in ("passwd", "secret", "rel", "dangling", "dirlink"):
        assert os.path.islink(dst / name)
    assert os.readlink(dst / "secret") == str(secret)
    # Only the one real file's bytes were copied: neither /etc/passwd nor the secret was read.
    assert rep.files_copied == 1 and rep.bytes_copied == len(b"in tree")
    assert rep.dirs_created == 0
    assert sorted(os.listdir(dst)) == ["dangling", "dirlink", "passwd", "real.txt", "rel", "secret"]


def test_source_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    real = tmp_path / "real_exec"
    _write(real / "x", b"x")
    link = tmp_path / "execution"
    link.symlink_to(real)
    dst, rep = _copy(link, tmp_path)
    assert rep.files_copied == 0 and os.listdir(dst) == []
    assert rep.errors and "symlink" in rep.errors[0]


def test_fifo_and_socket_skipped_and_listed(tmp_path: Path) -> None:
    src = tmp_path / "execution"
    _write(src / "ok.txt", b"ok")
    os.mkfifo(src / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    sock_path = src / "s.sock"
    try:
        sock.bind(str(sock_path))
    except OSError:  # path too long for AF_UNIX on some hosts
        sock.close()
        sock = None  # type: ignore[assignment]
    try:
        dst, rep = _copy(src, tmp_path)
    finally:
        if sock is not None:
            sock.close()
    assert "pipe (fifo)" in rep.skipped_special
    if sock is not None:
        assert "s.sock (socket)" in rep.skipped_special
    assert not os.path.lexists(dst / "pipe")
    assert (dst / "ok.txt").read_bytes() == b"ok"
    assert rep.files_copied == 1 and not rep.errors


def test_cap_leaves_out_exactly_the_rest_and_fills_up(tmp_path: Path) -> None:
    src = tmp_path / "execution"
    size = 300 * KB
    for name in ("a", "b", "c", "d", "e"):
        _write(src / f"{name}.bin", name.encode() * size)
    _write(src / "f_small.txt", b"s" * 1000)  # after two misses, still fits
    _write(src / "sub" / "g.bin", b"g" * size)  # deeper: considered last
    _write(src / "sub" / "h.txt", b"h" * 2000)
    cap = 1024 * KB

    dst, rep = _copy(src, tmp_path, cap_bytes=cap)

    assert rep.bytes_copied <= cap
    assert rep.bytes_copied == 3 * size + 1000 + 2000
    assert rep.left_out == [
        LeftOut(path="d.bin", size=size, reason="cap"),
        LeftOut(path="e.bin", size=size, reason="cap"),
        LeftOut(path="sub/g.bin", size=size, reason="cap"),
    ]
    copied = sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file())
    assert copied == ["a.bin", "b.bin", "c.bin", "f_small.txt", "sub/h.txt"]
    assert rep.files_copied == 5
    total = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    assert total == rep.bytes_copied


def test_missing_source(tmp_path: Path) -> None:
    dst, rep = _copy(tmp_path / "nope", tmp_path)
    assert rep.source_missing
    assert rep.files_copied == 0 and rep.bytes_copied == 0 and not rep.errors
    assert os.listdir(dst) == []
    assert rep.model_dump()["source"] == str(tmp_path / "nope")


def test_undecodable_names_are_reported_json_safe(tmp_path: Path) -> None:
    src = tmp_path / "execution"
    src.mkdir()
    bad = os.fsencode(src) + b"/caf\xe9.txt"
    with open(bad, "wb") as f:
        f.write(b"x")
    _dst, rep = _copy(src, tmp_path, cap_bytes=0)
    assert rep.left_out[0].path == "caf\\xe9.txt"
    rep.model_dump_json()  # no surrogate errors


def _run(wf: Path, run_id: str, group: str, mtime_s: int, *, execution: bool = True) -> Path:
    run = wf / "runs" / run_id
    g = run / group
    g.mkdir(parents=True)
    if execution:
        (g / "execution").mkdir()
    os.utime(run, (mtime_s, mtime_s))
    return run


def test_newest_real_run(tmp_path: Path) -> None:
    wf = tmp_path / "wf"
    assert newest_real_run(wf, "bid") is None
    _run(wf, "r1", "bid", 1000)
    _run(wf, "r2", "bid", 3000)
    _run(wf, "test-abc", "bid", 9000)  # test runs never count
    _run(wf, "r3", "other", 8000)  # other group
    _run(wf, "r4", "bid", 7000, execution=False)  # no execution/ for this group
    elsewhere = _run(tmp_path / "elsewhere", "rx", "bid", 9500)
    (wf / "runs" / "r9-link").symlink_to(elsewhere)  # symlinked run dir: ignored
    assert newest_real_run(wf, "bid") == wf / "runs" / "r2" / "bid" / "execution"
    _run(wf, "r0", "bid", 3000)  # tie on mtime: larger name wins, so still r2
    assert newest_real_run(wf, "bid") == wf / "runs" / "r2" / "bid" / "execution"
    link_group = _run(wf, "r5", "x", 5000)
    (link_group / "bid").symlink_to(elsewhere / "bid")  # symlinked group folder: ignored
    os.utime(link_group, (5000, 5000))
    assert newest_real_run(wf, "bid") == wf / "runs" / "r2" / "bid" / "execution"
    with pytest.raises(ValueError):
        newest_real_run(wf, "../etc")


def _mixed_tree(src: Path) -> None:
    """Small and large files (the large ones go to the copy's helper thread) at two
    depths, a sparse one among them."""
    for i in range(6):
        _write(src / f"big{i}.bin", bytes([65 + i]) * (300 * KB + i * 7 * KB))
        _write(src / f"small{i}.txt", b"s" * (900 + i))
    for i in range(4):
        _write(src / "sub" / f"deep{i}.bin", bytes([97 + i]) * (280 * KB + i))
        _write(src / "sub" / f"tiny{i}.txt", b"t" * (10 + i))
    with open(src / "sparse.bin", "wb") as f:
        f.truncate(4 * 1024 * KB)
        f.seek(1024 * KB)
        f.write(b"d" * (300 * KB))


def _tree_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("cap_kb", [0, 250, 1500, 2300, 3100, 100_000])
def test_the_helper_thread_copies_and_leaves_out_what_one_thread_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap_kb: int
) -> None:
    """Large files' bytes are copied by a helper thread while the walk goes on; for any
    cap the report and the copied tree are the ones a copy without the helper gives."""
    from sandbox.prepare import copytree

    src = tmp_path / "execution"
    _mixed_tree(src)
    with_helper = tmp_path / "with"
    with_helper.mkdir()
    rep = copy_execution_tree(src, with_helper, cap_bytes=cap_kb * KB)
    monkeypatch.setattr(copytree, "_HELPER_MIN_BYTES", 1 << 62)  # nothing handed over
    alone = tmp_path / "alone"
    alone.mkdir()
    rep_alone = copy_execution_tree(src, alone, cap_bytes=cap_kb * KB)

    assert rep.model_dump(exclude={"dest"}) == rep_alone.model_dump(exclude={"dest"})
    assert _tree_of(with_helper) == _tree_of(alone)
    assert rep.bytes_copied <= cap_kb * KB
    if cap_kb == 100_000:
        assert _tree_of(with_helper) == _tree_of(src) and not rep.left_out
    # the sparse file stays sparse either way
    if (with_helper / "sparse.bin").exists():
        assert os.stat(with_helper / "sparse.bin").st_blocks * 512 < 1024 * KB


def test_a_failed_copy_of_a_large_file_is_reported_and_removed(tmp_path: Path) -> None:
    """A large file whose bytes the helper cannot write (the file size limit, EFBIG, a
    real error from the kernel) is reported as an error and leaves no half-copied file;
    the rest is copied."""
    import resource
    import signal

    src = tmp_path / "execution"
    _write(src / "a_big.bin", b"a" * (600 * KB))
    _write(src / "b_small.txt", b"b" * 1000)
    _write(src / "c_big.bin", b"c" * (700 * KB))
    dst = tmp_path / "dst"
    dst.mkdir()
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (512 * KB, old_limit[1]))
    try:
        rep = copy_execution_tree(src, dst)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)

    assert rep.errors_count == 2
    assert sorted(e.split(":")[0] for e in rep.errors) == ["a_big.bin", "c_big.bin"]
    assert rep.files_copied == 1 and rep.bytes_copied == 1000
    assert sorted(os.listdir(dst)) == ["b_small.txt"]
