"""The docs say only what is true of this checkout.

- The reference pages are what `scripts/gen_docs.py` makes from the code, and every
  field they list is described.
- Every repository path the README or a docs page names (in backticks or as a link)
  exists; every `sandbox <command>` they name is a command of the parser, with options
  it has; every `make <target>` is a target of the Makefile.
- The README stays a front page: at most 150 lines.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.cli import build_parser
from tests import paths

ROOT = paths.REPO
README_BUDGET = 150
# A repository path starts with one of the repository's own top-level entries.
TOP_LEVEL = (
    "sandbox/",
    "tests/",
    "bench/",
    "testbed/",
    "examples/",
    "scripts/",
    "docs/",
    ".ci/",
)
# Names that look like modules and are Docker labels of the project's containers.
LABELS = frozenset({"sandbox.managed", "sandbox.bench"})
TOP_FILES = ("Makefile", "pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "mkdocs.yml")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _spans(text: str) -> Iterator[str]:
    """Inline code spans and link targets, and each line of a fenced block."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            yield line
            continue
        yield from re.findall(r"`([^`]+)`", line)
        yield from re.findall(r"\]\(([^)\s]+)\)", line)


def repository_paths(text: str) -> set[str]:
    found = set()
    for span in _spans(text):
        for word in re.split(r"[\s,;()\[\]=\"']+", span):
            word = word.rstrip(".:")
            if any(c in word for c in "<>*$…{}") or "..." in word:
                continue
            if word.startswith(TOP_LEVEL) or word in TOP_FILES:
                found.add(word.split("::")[0])
    return found


def modules_named(text: str) -> set[str]:
    """Dotted names like `sandbox.prepare.contenthash` in inline code."""
    found = set(re.findall(r"`(sandbox(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`", text))
    return found - LABELS


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def commands_named(text: str) -> set[tuple[str, tuple[str, ...]]]:
    """Each `sandbox CMD --opt ...` with the options it shows."""
    found = set()
    for span in _spans(text):
        for match in re.finditer(r"(?:^|[\s$`(])sandbox ([a-z][a-z-]*)((?: +[^|#]*)?)", span):
            options = tuple(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", match.group(2)))
            found.add((match.group(1), options))
    return found


def make_targets_named(text: str) -> set[str]:
    found = set()
    for span in _spans(text):
        found |= set(re.findall(r"(?:^|[\s$`(])make ([a-z][a-z-]*)", span))
    return found


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_command_and_target_the_docs_name_exists(page: Path) -> None:
    text = page.read_text()
    missing = [p for p in sorted(repository_paths(text)) if not (ROOT / p).exists()]
    commands = _subcommands()
    for name, options in sorted(commands_named(text)):
        if name not in commands:
            missing.append(f"sandbox {name}: no such command")
            continue
        known = {o for a in commands[name]._actions for o in a.option_strings}
        missing += [f"sandbox {name} {o}: no such option" for o in options if o not in known]
    targets = makefile_targets()
    missing += [f"make {t}: no such target" for t in sorted(make_targets_named(text) - targets)]
    for dotted in sorted(modules_named(text)):
        if not _resolves(dotted):
            missing.append(f"{dotted}: no such module or attribute")
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {missing}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_checker_catches_what_does_not_exist() -> None:
    text = (
        "see `sandbox/nowhere.py`, run `sandbox frobnicate` and `sandbox gate --frob`, `make nope`"
    )
    assert "sandbox/nowhere.py" in repository_paths(text)
    assert ("frobnicate", ()) in commands_named(text)
    assert ("gate", ("--frob",)) in commands_named(text)
    assert "nope" in make_targets_named(text)
    assert not _resolves("sandbox.policy.no_such_thing")
    assert _resolves("sandbox.policy.EFFECTS_TABLE")


def test_reference_pages_are_what_the_code_generates() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_BUDGET, f"README.md has {len(lines)} lines (budget {README_BUDGET})"
    text = "\n".join(lines)
    assert "make demo" in text and "make test" in text
