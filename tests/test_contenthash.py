"""The content hash names every part that defines a step, and only those."""

from __future__ import annotations

import os
from pathlib import Path

from sandbox.contracts.config import load_workflow
from sandbox.prepare.contenthash import changed_parts, content_hash, policy_version
from tests.conftest import write_workflow


def _hash(wf: Path, images: dict[str, str] | None = None) -> dict[str, str]:
    workflow = load_workflow(wf)
    step = workflow.step("step1")
    prompt = (wf / step.prompt_file).read_text() if step.prompt_file else None
    return content_hash(wf, workflow, step, prompt, images or {"step": "sha256:1"}).parts


def test_each_part_is_named_and_one_byte_changes_only_its_part(tmp_path: Path) -> None:
    wf = write_workflow(tmp_path, command="python3 /workflow/code/a.py", prompt="Do it.\n")
    (wf / "code" / "a.py").write_text("print(1)\n")
    (wf / "code" / "lib").mkdir()
    (wf / "code" / "lib" / "b.py").write_text("X = 1\n")
    before = _hash(wf)
    assert set(before) == {
        "command",
        "workflow.toml step entry",
        "mcp servers",
        "policy table",
        "prompt.md",
        "code/a.py",
        "code/lib/b.py",
        "image step",
    }
    assert before["policy table"] == policy_version()
    (wf / "code" / "lib" / "b.py").write_text("X = 2\n")
    assert changed_parts(before, _hash(wf)) == ["code/lib/b.py"]
    (wf / "prompt.md").write_text("Do it!\n")
    assert "prompt.md" in changed_parts(before, _hash(wf))
    assert changed_parts(before, _hash(wf, {"step": "sha256:2"})) == [
        "code/lib/b.py",
        "image step",
        "prompt.md",
    ]


def test_expectations_are_not_part_of_the_step_and_links_are_not_followed(
    tmp_path: Path,
) -> None:
    wf = write_workflow(tmp_path, command="true")
    outside = tmp_path / "secret.txt"
    outside.write_text("host file")
    os.symlink(outside, wf / "code" / "link.py")
    before = _hash(wf)
    assert before["code/link.py"] == f"link:{outside}"
    outside.write_text("changed host file")
    text = (wf / "workflow.toml").read_text()
    (wf / "workflow.toml").write_text(text + '\n[[steps.expect]]\nkind = "status"\n')
    assert changed_parts(before, _hash(wf)) == []
    (wf / "workflow.toml").write_text(text.replace("timeout_s = 60", "timeout_s = 61"))
    assert changed_parts(before, _hash(wf)) == ["workflow.toml step entry"]
