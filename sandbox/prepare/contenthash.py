"""The step's version: everything that decides what it does, as one digest with named parts.

A verification counts for exactly the version it tested. The version is:

- every file of the workflow folder that is not data, by content (`sandbox.prepare
  .treehash`): `workflow.toml`, `code/`, `scripts/`, `lib/`, `config/`, any new folder,
  dotfiles; links by their target's content. Data is the spec's (`db/`, `runs/`,
  `learnings/`, `knowledgebase/`, `planning/`, top level), what `[version] data` in
  `workflow.toml` declares, and the sandbox's own lock files. The step sees the whole
  folder read-only, so anything it can read that is not declared data is code, wherever
  its author put it;
- `workflow.toml` twice: its bytes (a part named `workflow.toml`: comments and
  expectations included, since the step can read the file) and each section of its
  parsed model (`workflow.toml [egress]`, `workflow.toml [[steps]] <id>` without its
  expectations, ...), so the gate can name the section that changed;
- the files the step names, wherever they live, even inside data: each `/workflow/...`
  path in its command (the program it runs), its `prompt_file`, the egress CA files;
- the command line, the policy table's version and the images' ids. An image named by
  tag (as a cluster's Pods may name it) names no content: the hash does not cover it.

Crew folders are not part of it: they belong to another project (their own version is
that project's) and are the step's read-only input, like the DB; their names and paths
are (`workflow.toml [[crew_folders]]`), and one that lies inside the workflow folder is
hashed with it. The group folder's copy of the last real run is input too.

Never a silent cut: whatever could not be hashed makes `ContentHash.complete` False with
the reason in `not_covered`, and the gate refuses that version.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import posixpath
import shlex
from pathlib import Path
from typing import Any, Final

from sandbox.contracts import names
from sandbox.contracts.config import SPEC_DATA, WORKFLOW_FILE, Step, Workflow
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.layout import C_WORKFLOW
from sandbox.contracts.record import ContentHash
from sandbox.prepare.lock import INFO_DIR_NAME, LOCK_FILE_NAME
from sandbox.prepare.treehash import MAX_REASONS, Parts, TreeHash, file_part, hash_tree

# The sandbox's own bookkeeping in the workflow folder: changed by every run's lock.
OWN_FILES: Final = (LOCK_FILE_NAME, INFO_DIR_NAME)
TOML_PART: Final = WORKFLOW_FILE
STEP_EXCLUDED: Final = frozenset({"expect", "expect_file"})  # they judge the step


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha_json(value: object) -> str:
    return _sha(json.dumps(value, sort_keys=True, default=str).encode())


# Every module that decides a verdict, in a fixed order: the effects table and the SQL
# classifier it puts `sql` arguments to. A change to any of them is a new policy.
POLICY_MODULES: Final = ("sandbox.policy", "sandbox.policy_sql")


def policy_version(modules: tuple[str, ...] = POLICY_MODULES) -> str:
    """The policy's version: one hash over the files of the modules that decide a
    verdict, each named, in order (found, not imported: the runner never evaluates the
    table itself)."""
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ConfigError(f"{name} is not installed beside this package")
        with open(spec.origin, "rb") as handle:
            digest.update(f"{name}\0{_sha(handle.read())}\n".encode())
    return digest.hexdigest()


def data_matcher(workflow: Workflow) -> Any:
    """`is_data(parts)`: True for a path inside the workflow's data."""
    declared = [tuple(d.split("/")) for d in workflow.version.data]

    def is_data(parts: Parts) -> bool:
        if len(parts) >= 1 and (parts[0] in SPEC_DATA or parts[0] in OWN_FILES):
            return True
        return any(parts[: len(d)] == d for d in declared)

    return is_data


def toml_sections(workflow: Workflow) -> dict[str, str]:
    """One part per section of the parsed `workflow.toml` (every field, defaults
    included, so a section added later is covered without a change here)."""
    parts: dict[str, str] = {}
    for key, value in workflow.model_dump(mode="json").items():
        if key == "steps":
            for entry in value:
                kept = {k: v for k, v in entry.items() if k not in STEP_EXCLUDED}
                parts[f"{TOML_PART} [[steps]] {entry['id']}"] = _sha_json(kept)
        elif isinstance(value, list):
            parts[f"{TOML_PART} [[{key}]]"] = _sha_json(value)
        elif isinstance(value, dict):
            parts[f"{TOML_PART} [{key}]"] = _sha_json(value)
        else:
            parts[f"{TOML_PART} {key}"] = _sha_json(value)
    return parts


def named_files(workflow: Workflow, step: Step) -> list[str]:
    """Paths (relative to the workflow folder) the step names: each `/workflow/...` in its
    command (also after `=`, as in `--config=/workflow/x`), its prompt, the CA files."""
    out: list[str] = []
    if step.command is not None:
        if isinstance(step.command, list):
            words = list(step.command)
        else:
            try:
                words = shlex.split(step.command)
            except ValueError:
                words = step.command.split()
        for word in words:
            for token in (word, word.partition("=")[2]):
                norm = posixpath.normpath(token) if token.startswith(C_WORKFLOW + "/") else ""
                if norm.startswith(C_WORKFLOW + "/"):
                    out.append(norm[len(C_WORKFLOW) + 1 :])
    if step.prompt_file is not None:
        out.append(posixpath.normpath(step.prompt_file))
    out += [posixpath.normpath(f) for f in workflow.egress.trust_ca_files]
    return out


def content_hash(
    workflow_dir: Path, workflow: Workflow, step: Step, images: dict[str, str]
) -> ContentHash:
    tree: TreeHash = hash_tree(workflow_dir, data_matcher(workflow))
    parts: dict[str, str] = {
        "command": _sha(step.display_command().encode()),
        "policy table": policy_version(),
    }
    parts.update(toml_sections(workflow))
    parts.update(tree.parts)
    for rel in named_files(workflow, step):
        if rel not in parts:
            parts[rel] = file_part(workflow_dir, rel, tree)
    if TOML_PART not in parts:  # a workflow.toml it could not read is not a version
        tree.miss(f"{TOML_PART}: not hashed")
    for role, image in sorted(images.items()):
        parts[f"image {role}"] = image
        if not names.names_content(image):
            tree.miss(f"image {role}: {image} is named by tag, not by content")
    missed = tree.not_covered
    shown = missed[:MAX_REASONS] + (
        [f"and {len(missed) - MAX_REASONS} more"] if len(missed) > MAX_REASONS else []
    )
    digest = _sha_json([sorted(parts.items()), shown])
    return ContentHash(digest=digest, parts=parts, complete=not missed, not_covered=shown)


def changed_parts(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Names of the parts that differ (added, removed or changed), sorted."""
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


def not_covered_reason(content: ContentHash) -> str:
    """Why a version cannot be vouched for ("" when its hash covered everything)."""
    if content.complete:
        return ""
    what = "; ".join(content.not_covered[:3]) or "its hash does not say it covered everything"
    return f"the version hash could not cover {what}"
