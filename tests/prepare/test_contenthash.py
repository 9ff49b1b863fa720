"""The content hash names every part that defines a step, covers the whole workflow folder
but its data, and says so when it could not cover everything."""

from __future__ import annotations

import importlib.util
import os
import pkgutil
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest

import sandbox
from sandbox.contracts.config import load_workflow
from sandbox.contracts.record import ContentHash
from sandbox.prepare import contenthash, treehash
from sandbox.prepare.contenthash import changed_parts, content_hash, policy_version
from tests.conftest import write_workflow

IMAGE_ID = "sha256:" + "1" * 64


def _content(wf: Path, images: dict[str, str] | None = None) -> ContentHash:
    workflow = load_workflow(wf)
    step = workflow.step("step1")
    return content_hash(wf, workflow, step, images or {"step": IMAGE_ID})


def _hash(wf: Path, images: dict[str, str] | None = None) -> dict[str, str]:
    content = _content(wf, images)
    assert content.complete, content.not_covered
    return content.parts


def test_each_part_is_named_and_one_byte_changes_only_its_part(tmp_path: Path) -> None:
    wf = write_workflow(tmp_path, command="python3 /workflow/code/a.py", prompt="Do it.\n")
    (wf / "code" / "a.py").write_text("print(1)\n")
    (wf / "code" / "lib").mkdir()
    (wf / "code" / "lib" / "b.py").write_text("X = 1\n")
    before = _hash(wf)
    assert {
        "command",
        "workflow.toml",
        "workflow.toml [[steps]] step1",
        "workflow.toml [[mcp_servers]]",
        "workflow.toml [egress]",
        "workflow.toml [bridge]",
        "workflow.toml [limits]",
        "workflow.toml [version]",
        "policy table",
        "prompt.md",
        "code/a.py",
        "code/lib/b.py",
        "image step",
    } <= set(before)
    assert before["policy table"] == policy_version()
    (wf / "code" / "lib" / "b.py").write_text("X = 2\n")
    assert changed_parts(before, _hash(wf)) == ["code/lib/b.py"]
    (wf / "prompt.md").write_text("Do it!\n")
    assert "prompt.md" in changed_parts(before, _hash(wf))
    assert changed_parts(before, _hash(wf, {"step": "sha256:" + "2" * 64})) == [
        "code/lib/b.py",
        "image step",
        "prompt.md",
    ]


def test_files_outside_code_are_part_of_the_version(tmp_path: Path) -> None:
    """Issue 31's cases: the program outside code/, a helper in lib/, a settings file."""
    wf = write_workflow(tmp_path, command="python3 /workflow/scripts/bid.py")
    for rel, text in (
        ("scripts/bid.py", "import helper\n"),
        ("lib/helper.py", "N = 1\n"),
        ("config/bid.json", '{"proposals": 1}\n'),
    ):
        (wf / rel).parent.mkdir(exist_ok=True)
        (wf / rel).write_text(text)
    before = _hash(wf)
    for rel, text in (
        ("scripts/bid.py", "import helper  # two\n"),
        ("lib/helper.py", "N = 2\n"),
        ("config/bid.json", '{"proposals": 2}\n'),
    ):
        old = (wf / rel).read_text()
        (wf / rel).write_text(text)
        assert changed_parts(before, _hash(wf)) == [rel]
        (wf / rel).write_text(old)
    # A new folder is code until it is declared data.
    (wf / "extra").mkdir()
    (wf / "extra" / "x.py").write_text("1\n")
    assert changed_parts(before, _hash(wf)) == ["extra/x.py"]


def test_workflow_toml_sections_are_named(tmp_path: Path) -> None:
    wf = write_workflow(
        tmp_path,
        extra_toml='[egress]\nallow = ["api.example.com"]\n[bridge]\ndefault_budget_s = 30\n'
        "[limits]\nmemory_mb = 512\n",
    )
    before = _hash(wf)
    text = (wf / "workflow.toml").read_text()
    for old, new, section in (
        ('"api.example.com"', '"api.example.com", "other.example.com"', "[egress]"),
        ("default_budget_s = 30", "default_budget_s = 31", "[bridge]"),
        ("memory_mb = 512", "memory_mb = 513", "[limits]"),
    ):
        (wf / "workflow.toml").write_text(text.replace(old, new))
        assert changed_parts(before, _hash(wf)) == ["workflow.toml", f"workflow.toml {section}"]
    # Expectations judge the step: only the file's bytes change, no section.
    (wf / "workflow.toml").write_text(text + '\n[[steps.expect]]\nkind = "status"\n')
    assert changed_parts(before, _hash(wf)) == ["workflow.toml"]


def test_data_is_not_the_version_but_what_the_step_names_is(tmp_path: Path) -> None:
    wf = write_workflow(
        tmp_path,
        command="python3 /workflow/knowledgebase/tool.py",
        extra_toml='[version]\ndata = ["exports/"]\n',
    )
    for rel in ("knowledgebase/notes.md", "knowledgebase/tool.py", "exports/out.csv"):
        (wf / rel).parent.mkdir(exist_ok=True)
        (wf / rel).write_text("1\n")
    (wf / "runs" / "r1").mkdir(parents=True)
    (wf / "runs" / "r1" / "out.txt").write_text("1\n")
    (wf / ".sandbox.lock").write_text("")
    before = _hash(wf)
    assert "knowledgebase/notes.md" not in before and "exports/out.csv" not in before
    for rel in ("knowledgebase/notes.md", "exports/out.csv", "runs/r1/out.txt", ".sandbox.lock"):
        (wf / rel).write_text("2\n")
    assert changed_parts(before, _hash(wf)) == []
    (wf / "knowledgebase" / "tool.py").write_text("2\n")  # the program, inside data
    assert changed_parts(before, _hash(wf)) == ["knowledgebase/tool.py"]


def test_links_are_hashed_by_their_target_inside_the_folder(tmp_path: Path) -> None:
    wf = write_workflow(tmp_path)
    (wf / "shared").mkdir()
    (wf / "shared" / "cfg.py").write_text("A = 1\n")
    os.symlink("../shared/cfg.py", wf / "code" / "rel.py")
    os.symlink("/workflow/shared/cfg.py", wf / "code" / "abs.py")
    os.symlink("/etc/hostname", wf / "code" / "out.txt")
    os.symlink("nothing-here", wf / "code" / "dangling.py")
    os.symlink("loop", wf / "code" / "loop")
    before = _hash(wf)
    assert before["code/out.txt"] == "link out of the folder:/etc/hostname"
    assert before["code/dangling.py"] == "link dangling:nothing-here"
    assert before["code/loop"] == "link loop:loop"
    (wf / "shared" / "cfg.py").write_text("A = 2\n")
    assert changed_parts(before, _hash(wf)) == ["code/abs.py", "code/rel.py", "shared/cfg.py"]
    (wf / "code" / "nothing-here").write_text("now it is\n")
    assert "code/dangling.py" in changed_parts(before, _hash(wf))


def test_a_link_target_in_data_is_still_hashed(tmp_path: Path) -> None:
    wf = write_workflow(tmp_path)
    (wf / "planning").mkdir()
    (wf / "planning" / "plan.py").write_text("1\n")
    os.symlink("../planning/plan.py", wf / "code" / "plan.py")
    before = _hash(wf)
    (wf / "planning" / "plan.py").write_text("2\n")
    assert changed_parts(before, _hash(wf)) == ["code/plan.py"]


def test_a_tree_past_twenty_thousand_entries_is_covered_whole(tmp_path: Path) -> None:
    wf = write_workflow(tmp_path)
    vendored = wf / "code" / "node_modules"
    for i in range(21_000):
        sub = vendored / f"p{i // 1000:02d}"
        if i % 1000 == 0:
            sub.mkdir(parents=True)
        (sub / f"m{i:05d}.js").write_text(f"{i}\n")
    content = _content(wf)
    assert content.complete, content.not_covered
    assert len(content.parts) <= treehash.MAX_LISTED + 50  # listed by folder, not cut
    (vendored / "p20" / "m20999.js").write_text("changed\n")  # the last entry of all
    changed = changed_parts(content.parts, _hash(wf))
    assert changed == ["code/node_modules/p20/"], changed


def test_what_cannot_be_hashed_makes_the_hash_incomplete(tmp_path: Path) -> None:
    wf = write_workflow(tmp_path)
    assert _content(wf).complete
    os.mkfifo(wf / "code" / "pipe")
    content = _content(wf)
    assert not content.complete
    assert content.not_covered == ["code/pipe: a fifo (its content cannot be hashed)"]


def test_a_change_to_the_sql_classifier_is_a_new_policy_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SQL classifier decides verdicts as much as the table does: a verification of
    the old classifier must not count for a new one."""
    real = importlib.util.find_spec
    origin = real("sandbox.policy_sql").origin  # type: ignore[union-attr]
    assert origin is not None
    changed = tmp_path / "policy_sql.py"
    text = Path(origin).read_text(encoding="utf-8")
    changed.write_text(text.replace('"SELECT", "VALUES"', '"SELECT", "VALUES", "PRAGMA"'))
    assert changed.read_text(encoding="utf-8") != text

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        if name == "sandbox.policy_sql":
            return ModuleSpec(name, None, origin=str(changed))
        return real(name, package)

    before = policy_version()
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert policy_version() != before


def test_every_module_of_the_policy_is_in_its_version() -> None:
    package = Path(sandbox.__file__).parent
    policy_modules = {f"sandbox.{m.name}" for m in pkgutil.iter_modules([str(package)])}
    assert {m for m in policy_modules if m.startswith("sandbox.policy")} == set(
        contenthash.POLICY_MODULES
    )


@pytest.mark.parametrize(
    "image",
    [
        IMAGE_ID,
        "registry.example/sandbox-step@sha256:" + "a" * 64,
        "sandbox-step:h1@sha256:" + "b" * 64,
    ],
)
def test_an_image_named_by_content_is_covered(tmp_path: Path, image: str) -> None:
    content = _content(write_workflow(tmp_path), {"step": image, "mcp": IMAGE_ID})
    assert content.complete, content.not_covered
    assert content.parts["image step"] == image


@pytest.mark.parametrize(
    "image",
    [
        "registry.example/sandbox-step:h1",
        "sandbox-step:h1",
        "sha256:1",
        "registry.example/sandbox-step@sha256:" + "A" * 64,
        "registry.example/sandbox-step@sha256:" + "a" * 63,
    ],
)
def test_an_image_named_by_tag_leaves_the_version_uncovered(tmp_path: Path, image: str) -> None:
    """A tag names whatever was pushed under it last: vouching for it would vouch for code
    never hashed (a cluster's Pods name their images by reference, not by id)."""
    content = _content(write_workflow(tmp_path), {"step": IMAGE_ID, "mcp": image})
    assert not content.complete
    assert content.not_covered == [f"image mcp: {image} is named by tag, not by content"]
    assert contenthash.not_covered_reason(content) == (
        f"the version hash could not cover image mcp: {image} is named by tag, not by content"
    )
