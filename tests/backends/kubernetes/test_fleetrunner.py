"""What a chain step's runner accepts as its seed (pure: no cluster): only what it
finds itself (the real DB, the newest real run) or what an earlier step of its own
chain left under the chain's steps, never a path elsewhere nor through a link."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.backends.kubernetes.fleetrunner import _seed
from sandbox.contracts.errors import SandboxError


@pytest.fixture
def steps(tmp_path: Path) -> Path:
    steps = tmp_path / "wf" / "runs" / "test-abc" / "steps"
    (steps / "1-pick" / "db").mkdir(parents=True)
    return steps


def test_a_seed_is_the_real_one_nothing_or_what_an_earlier_step_left(steps: Path) -> None:
    wf = steps.parents[2]
    real = wf / "db" / "db.sqlite"
    assert _seed(wf, "real", real, steps) == real
    assert _seed(wf, "-", real, steps) is None
    left = "runs/test-abc/steps/1-pick/db/db.sqlite"
    assert _seed(wf, left, real, steps) == wf / left


@pytest.mark.parametrize(
    "spec",
    [
        "/etc/passwd",
        "db/db.sqlite",  # the real DB, named as a path: only `real` names it
        "runs/test-other/steps/1-pick/db/db.sqlite",
        "runs/test-abc/steps/../../test-other/x",
    ],
)
def test_a_seed_anywhere_else_is_refused(steps: Path, spec: str) -> None:
    with pytest.raises(SandboxError, match="not under the chain's steps"):
        _seed(steps.parents[2], spec, None, steps)


def test_a_seed_through_a_link_is_refused(steps: Path, tmp_path: Path) -> None:
    (steps / "2-submit").symlink_to(tmp_path)
    with pytest.raises(SandboxError, match="a link"):
        _seed(steps.parents[2], "runs/test-abc/steps/2-submit/x", None, steps)
