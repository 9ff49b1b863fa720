"""The content hash of a step: everything that defines what it does, as one digest.

A verification counts for exactly the version it tested, so the record carries
a hash of each part that shapes the step's behaviour: its command, its
`workflow.toml` entry (expectations left out: they judge the step, they are not
it), its prompt, every file of the workflow's `code/` folder (the step can read
all of it: the workflow folder is mounted read-only), the MCP servers'
configuration, the policy table's version (the hash of the module that holds
it), and the images' ids. The parts are kept by name so a gate can say which
one changed ("code/bid-submit.py").

Limits: files the step reads outside `code/` (its group folder's earlier run, the
Crew folders, the DB) are its input, not its definition, and are not hashed. The
walk never follows a link: a link is hashed as its target text; anything not a
regular file or a folder is hashed as its type alone.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import stat
from pathlib import Path
from typing import Final

from sandbox.contracts.config import Step, Workflow
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.record import ContentHash

CODE_DIR = "code"
MAX_CODE_ENTRIES = 20_000


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha_json(value: object) -> str:
    return _sha(json.dumps(value, sort_keys=True, default=str).encode())


def _hash_fd(fd: int) -> str:
    digest = hashlib.sha256()
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _entry_hash(name: str, dirfd: int) -> str:
    entry = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    if stat.S_ISLNK(entry.st_mode):
        return "link:" + os.readlink(name, dir_fd=dirfd)
    if not stat.S_ISREG(entry.st_mode):
        return f"special:{stat.S_IFMT(entry.st_mode):o}"
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the stat
            return "special:changed"
        return _hash_fd(fd) + ("+x" if entry.st_mode & 0o111 else "")
    finally:
        os.close(fd)


def code_parts(workflow_dir: Path) -> dict[str, str]:
    """`code/<path>` -> hash, for every entry below the code folder (links not followed)."""
    root = workflow_dir / CODE_DIR
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return {}
    if stat.S_ISLNK(st.st_mode):
        return {CODE_DIR: "link:" + os.readlink(root)}
    parts: dict[str, str] = {}

    def unreadable(exc: OSError) -> None:  # a folder the walk cannot list is named too
        where = Path(os.path.relpath(str(exc.filename), workflow_dir)).as_posix()
        parts[where] = f"unreadable:{exc.errno}"

    walk = os.fwalk(root, follow_symlinks=False, onerror=unreadable)
    for dirpath, dirnames, filenames, dirfd in walk:
        dirnames.sort()
        rel_dir = Path(os.path.relpath(dirpath, workflow_dir)).as_posix()
        for name in sorted(filenames) + [
            d for d in dirnames if os.path.islink(os.path.join(dirpath, d))
        ]:
            key = f"{rel_dir}/{name}"
            try:
                parts[key] = _entry_hash(name, dirfd)
            except OSError as exc:  # vanished or unreadable: named, never a crash
                parts[key] = f"unreadable:{exc.errno}"
            if len(parts) > MAX_CODE_ENTRIES:
                parts["code/[cut]"] = f"more than {MAX_CODE_ENTRIES} entries"
                return parts
    return parts


POLICY_MODULE: Final = "sandbox.policy"


def policy_version() -> str:
    """The policy table's version: the hash of the module that is its one source (found,
    not imported: the runner never evaluates the table itself)."""
    spec = importlib.util.find_spec(POLICY_MODULE)
    if spec is None or spec.origin is None:
        raise ConfigError(f"{POLICY_MODULE} is not installed beside this package")
    with open(spec.origin, "rb") as handle:
        return _sha(handle.read())


def read_prompt(workflow_dir: Path, step: Step) -> str | None:
    """The step's prompt as a run reads it (no link followed); ConfigError if unreadable."""
    if step.prompt_file is None:
        return None
    path = workflow_dir / step.prompt_file
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"step {step.id}: prompt_file {path} unreadable: {exc}") from None


def content_hash(
    workflow_dir: Path,
    workflow: Workflow,
    step: Step,
    prompt: str | None,
    images: dict[str, str],
) -> ContentHash:
    entry = step.model_dump(mode="json", exclude={"expect", "expect_file"})
    parts: dict[str, str] = {
        "command": _sha(step.display_command().encode()),
        "workflow.toml step entry": _sha_json(entry),
        "mcp servers": _sha_json([s.model_dump(mode="json") for s in workflow.mcp_servers]),
        "policy table": policy_version(),
    }
    if prompt is not None and step.prompt_file is not None:
        parts[step.prompt_file] = _sha(prompt.encode())
    parts.update(code_parts(workflow_dir))
    parts.update({f"image {role}": image for role, image in sorted(images.items())})
    return ContentHash(digest=_sha_json(sorted(parts.items())), parts=parts)


def changed_parts(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Names of the parts that differ (added, removed or changed), sorted."""
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
