"""Tests for sandbox.stepside.agentworks_exec.pathsafety."""

from __future__ import annotations

from typing import Any

import pytest

from sandbox.stepside.agentworks_exec.pathsafety import (
    MAX_PATH_CHARS,
    check_tool_path,
    normalize_tool_path,
)

SAFE = [
    ".",
    "./",
    "a",
    "a.txt",
    "out/result.json",
    "./out//result.json",
    "out/",
    "dir/.hidden",
    ".gitignore",
    ".github/workflows/x.yml",
    "a/git/b",
    "a/.git-notes",
    "a/..b",
    "a/b..",
    "...",
    "a/~b",
    "name with spaces.txt",
    "résumé.pdf",
    "x" * MAX_PATH_CHARS,
]


@pytest.mark.parametrize("path", SAFE)
def test_safe_paths(path: str) -> None:
    assert check_tool_path(path) is None


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        (None, "path must be a string"),
        (b"a.txt", "path must be a string"),
        (3, "path must be a string"),
        (["a"], "path must be a string"),
        ("", "path is empty"),
        ("a\x00b", "path contains a NUL byte"),
        ("a\nb", "path contains a control character"),
        ("a\x7fb", "path contains a control character"),
        ("/etc/passwd", "absolute paths are not allowed; use a path relative to the group folder"),
        (
            "//server/share",
            "absolute paths are not allowed; use a path relative to the group folder",
        ),
        ("~", "paths starting with '~' are not allowed"),
        ("~/x", "paths starting with '~' are not allowed"),
        ("~root/x", "paths starting with '~' are not allowed"),
        ("..", "'..' components are not allowed"),
        ("../x", "'..' components are not allowed"),
        ("a/../../x", "'..' components are not allowed"),
        ("a/..", "'..' components are not allowed"),
        ("a/b/../c", "'..' components are not allowed"),
        (".git", "'.git' components are not allowed"),
        (".git/config", "'.git' components are not allowed"),
        ("a/.git/hooks/pre-commit", "'.git' components are not allowed"),
        ("a/.GIT/config", "'.git' components are not allowed"),
        ("a/.Git", "'.git' components are not allowed"),
        ("./.git/", "'.git' components are not allowed"),
        ("a\\b", "backslashes are not allowed in paths"),
        ("..\\x", "backslashes are not allowed in paths"),
        ("C:\\x", "backslashes are not allowed in paths"),
        ("x" * (MAX_PATH_CHARS + 1), "path is too long (over 4096 characters)"),
    ],
)
def test_unsafe_paths(path: Any, reason: str) -> None:
    assert check_tool_path(path) == reason


@pytest.mark.parametrize(
    ("path", "normalized"),
    [
        (".", "."),
        ("./", "."),
        ("././", "."),
        ("a", "a"),
        ("a/", "a"),
        ("./a//b/./c", "a/b/c"),
        ("out/result.json", "out/result.json"),
        ("dir/.hidden", "dir/.hidden"),
    ],
)
def test_normalize(path: str, normalized: str) -> None:
    assert normalize_tool_path(path) == normalized


@pytest.mark.parametrize("path", ["../x", "/etc", "a/.git", "", "a\\b", "~"])
def test_normalize_refuses_unsafe(path: str) -> None:
    with pytest.raises(ValueError, match="unsafe tool path"):
        normalize_tool_path(path)


@pytest.mark.parametrize("path", SAFE)
def test_normalized_paths_stay_safe_and_stable(path: str) -> None:
    norm = normalize_tool_path(path)
    assert check_tool_path(norm) is None
    assert normalize_tool_path(norm) == norm
    assert not norm.startswith("/")
    assert ".." not in norm.split("/")
