"""Path safety for local agent tools (read/write/edit/list/search) in a test run.

Local tools take paths relative to the step's group folder (the root). This
module decides, purely from the string, whether such a path is acceptable:

* it must be a non-empty ``str`` of at most :data:`MAX_PATH_CHARS` characters;
* no NUL byte or other ASCII control character (they truncate paths in C code
  and forge lines in logs);
* no backslash (never a separator on POSIX, one on Windows: ambiguous);
* relative: not absolute, not starting with ``~`` (home expansion);
* no ``..`` component (no climbing out of the root) and no ``.git`` component,
  compared case-insensitively (no reaching into repository internals or hooks).

``"."`` names the root itself and is allowed.

What it does not do: it never touches the file system, so it cannot see
symlinks. Resolving the path under the root without following links out of it
is the caller's job (and the container's mounts are the real boundary).
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_PATH_CHARS", "check_tool_path", "normalize_tool_path"]

MAX_PATH_CHARS: Final = 4096


def check_tool_path(path: object) -> str | None:
    """Return None if ``path`` is a safe relative tool path, else the refusal reason."""
    if not isinstance(path, str):
        return "path must be a string"
    if not path:
        return "path is empty"
    if len(path) > MAX_PATH_CHARS:
        return f"path is too long (over {MAX_PATH_CHARS} characters)"
    if "\x00" in path:
        return "path contains a NUL byte"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return "path contains a control character"
    if "\\" in path:
        return "backslashes are not allowed in paths"
    if path.startswith("/"):
        return "absolute paths are not allowed; use a path relative to the group folder"
    if path.startswith("~"):
        return "paths starting with '~' are not allowed"
    for part in path.split("/"):
        if part == "..":
            return "'..' components are not allowed"
        if part.lower() == ".git":
            return "'.git' components are not allowed"
    return None


def normalize_tool_path(path: str) -> str:
    """The normalized relative POSIX form of a path that passed :func:`check_tool_path`.

    Empty and ``.`` components are dropped (``./a//b/`` -> ``a/b``); the root is
    ``"."``. Raises ValueError for a path the check refuses.
    """
    reason = check_tool_path(path)
    if reason is not None:
        raise ValueError(f"unsafe tool path {path!r}: {reason}")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    return "/".join(parts) or "."
