"""The executor's file tools (`filetools.py`): inside the root, never out of it, capped.

Each test starts the executor as a real subprocess and calls it over real HTTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.stepside.agentworks_exec.executor import (
    Exec,
)


def test_write_read_roundtrip(ex: Exec) -> None:
    reply = ex.call("write_file", path="out/sub/a.txt", content="l0\nl1\nl2\nl3\n")
    assert reply["is_error"] is False, reply
    assert (ex.root / "out/sub/a.txt").read_text() == "l0\nl1\nl2\nl3\n"
    assert ex.call("read_file", path="out/sub/a.txt")["text"] == "l0\nl1\nl2\nl3\n"
    reply = ex.call("read_file", path="./out//sub/a.txt", offset=1, limit=2)
    assert reply["text"] == "l1\nl2\n"
    assert reply["data"]["next_offset"] == 3
    assert ex.call("read_file", path="nope.txt")["is_error"] is True
    assert ex.call("read_file", path="out")["is_error"] is True


def test_read_is_capped(ex: Exec) -> None:
    (ex.root / "big.txt").write_text(("x" * 1023 + "\n") * 300)  # 300 KiB
    reply = ex.call("read_file", path="big.txt")
    assert reply["is_error"] is False
    assert reply["data"]["truncated"] is True
    assert reply["text"].startswith("x" * 1023 + "\n")
    body, note = reply["text"].rsplit("\n[... cut at 256 KiB", 1)
    assert len(body.encode()) == 256 * 1024
    assert "offset=257" in note


REFUSED_PATHS = ["../x", "a/../../x", "/etc/passwd", "~/x", "~", ".git/config", "a/.GIT/x", ""]


@pytest.mark.parametrize("path", REFUSED_PATHS)
def test_unsafe_paths_refused(ex: Exec, path: str) -> None:
    for tool, extra in [
        ("read_file", {}),
        ("write_file", {"content": "x"}),
        ("edit_file", {"old": "a", "new": "b"}),
        ("list_dir", {}),
        ("search_files", {"pattern": "x"}),
    ]:
        reply = ex.call(tool, path=path, **extra)
        assert reply["is_error"] is True, (tool, reply)
        assert "refused:" in reply["text"], (tool, reply)


def test_symlink_out_of_root_refused(ex: Exec, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    (ex.root / "out_dir").symlink_to(outside)
    (ex.root / "out_file").symlink_to(outside / "secret.txt")
    calls: list[tuple[str, dict[str, Any]]] = [
        ("read_file", {"path": "out_file"}),
        ("read_file", {"path": "out_dir/secret.txt"}),
        ("write_file", {"path": "out_dir/new.txt", "content": "x"}),
        ("write_file", {"path": "out_file", "content": "x"}),
        ("edit_file", {"path": "out_file", "old": "secret", "new": "x"}),
        ("list_dir", {"path": "out_dir"}),
        ("search_files", {"pattern": "secret", "path": "out_dir"}),
    ]
    for tool, args in calls:
        reply = ex.call(tool, **args)
        assert reply["is_error"] is True, (tool, reply)
        assert "refused: path leaves the group folder via a symlink" in reply["text"]
    assert (outside / "secret.txt").read_text() == "secret"
    assert not (outside / "new.txt").exists()
    # A search from the root does not follow the links out either.
    reply = ex.call("search_files", pattern="secret")
    assert reply["text"] == "no matches"


def test_write_never_follows_a_final_symlink(ex: Exec) -> None:
    (ex.root / "real.txt").write_text("real")
    (ex.root / "link.txt").symlink_to("real.txt")
    reply = ex.call("write_file", path="link.txt", content="new")
    assert reply["is_error"] is True
    assert "symlink" in reply["text"]
    assert (ex.root / "real.txt").read_text() == "real"
    # Reading through a link that stays inside the root is fine.
    assert ex.call("read_file", path="link.txt")["text"] == "real"


def test_edit_exactly_once(ex: Exec) -> None:
    (ex.root / "e.txt").write_text("alpha beta beta\r\n")
    reply = ex.call("edit_file", path="e.txt", old="alpha", new="ALPHA")
    assert reply["is_error"] is False, reply
    assert (ex.root / "e.txt").read_bytes() == b"ALPHA beta beta\r\n"
    reply = ex.call("edit_file", path="e.txt", old="beta", new="x")
    assert reply["is_error"] is True
    assert "old text occurs 2 times" in reply["text"]
    reply = ex.call("edit_file", path="e.txt", old="gamma", new="x")
    assert reply["is_error"] is True
    assert "old text occurs 0 times" in reply["text"]
    assert (ex.root / "e.txt").read_bytes() == b"ALPHA beta beta\r\n"
    assert ex.call("edit_file", path="e.txt", old="", new="x")["is_error"] is True
    assert ex.call("edit_file", path="missing.txt", old="a", new="b")["is_error"] is True


def test_list_dir(ex: Exec) -> None:
    (ex.root / "b.txt").write_text("")
    (ex.root / "a_dir").mkdir()
    (ex.root / "a_dir" / "inner").write_text("")
    (ex.root / "c_link").symlink_to("b.txt")
    reply = ex.call("list_dir")
    assert reply["is_error"] is False
    assert reply["data"]["entries"] == ["a_dir/", "b.txt", "c_link -> b.txt"]
    assert reply["text"] == "a_dir/\nb.txt\nc_link -> b.txt"
    assert ex.call("list_dir", path="a_dir")["data"]["entries"] == ["inner"]
    assert ex.call("list_dir", path="b.txt")["is_error"] is True


def test_list_dir_cap(ex: Exec) -> None:
    many = ex.root / "many"
    many.mkdir()
    for i in range(1005):
        (many / f"f{i:04d}").write_text("")
    reply = ex.call("list_dir", path="many")
    assert len(reply["data"]["entries"]) == 1000
    assert reply["data"]["truncated"] is True
    assert "5 more entries" in reply["text"]


def test_search_files(ex: Exec) -> None:
    (ex.root / "src").mkdir()
    (ex.root / "src" / "a.py").write_text("import os\nneedle = 1\n")
    (ex.root / "src" / "b.txt").write_text("no\nneedle here\n")
    (ex.root / "bin.dat").write_bytes(b"\x00needle")
    (ex.root / "huge.txt").write_text("needle\n" + "x" * (2 * 1024 * 1024))
    (ex.root / ".git").mkdir()
    (ex.root / ".git" / "config").write_text("needle\n")
    reply = ex.call("search_files", pattern=r"need+le")
    assert reply["is_error"] is False
    assert reply["text"] == "src/a.py:2: needle = 1\nsrc/b.txt:2: needle here"
    assert reply["data"]["matches"][0] == {"path": "src/a.py", "line": 2, "text": "needle = 1"}
    assert ex.call("search_files", pattern="needle", glob="*.py")["text"] == (
        "src/a.py:2: needle = 1"
    )
    assert ex.call("search_files", pattern="needle", path="src/b.txt")["text"] == (
        "src/b.txt:2: needle here"
    )
    bad = ex.call("search_files", pattern="(")
    assert bad["is_error"] is True and "invalid regular expression" in bad["text"]


def test_search_match_cap(ex: Exec) -> None:
    (ex.root / "m.txt").write_text("hit\n" * 600)
    reply = ex.call("search_files", pattern="hit")
    assert len(reply["data"]["matches"]) == 500
    assert reply["data"]["truncated"] is True
    assert "match cap 500" in reply["text"]
