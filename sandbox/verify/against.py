"""`sandbox verify --against last-passing|RUN`: the verdict and what the fix changed, in one place.

The baseline is the step's last passing verification in the workflow's history
(`sandbox.verify.history`; the run just verified is never its own baseline) or a run
the caller names (a run id under `runs/`, or a run folder). The new run is B, the
baseline A, so every line reads "before -> after". The verdict stands whatever the
comparison finds: when there is nothing to compare against (no passing verification
yet, its run folder removed, a record that cannot be compared) the result says so in
`not_compared` and carries no comparison; it is never an error after the run. A named
run that cannot be compared is a usage error before the step runs (`check_named`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from sandbox.contracts.errors import ConfigError
from sandbox.termsafe import clean
from sandbox.verify import history
from sandbox.verify.compare import compare_finished, load_finished
from sandbox.verify.diff import RunComparison
from sandbox.verify.finished import FinishedStep
from sandbox.verify.verification import RunDigest, Verification

LAST_PASSING = "last-passing"


class VerifiedAgainst(BaseModel):
    """A verification and its run compared with a baseline (A: the baseline, B: this run)."""

    verification: Verification
    against: str  # `last-passing`, or the run the caller named
    baseline_run: str | None = None  # the run compared against
    comparison: RunComparison | None = None
    not_compared: str = ""  # why there is no comparison

    @property
    def run_id(self) -> str:
        return self.verification.run_id

    @property
    def passed(self) -> bool:
        return self.verification.passed

    @property
    def digest(self) -> RunDigest:
        return self.verification.digest

    def lines(self) -> list[str]:
        out = self.verification.lines()
        if self.comparison is None:
            note = clean(f"against {self.against}: {self.not_compared}", keep_newlines=False)
            return [*out, note]
        what = "the last passing verification" if self.against == LAST_PASSING else "the run named"
        out.append(f"what changed against {self.baseline_run} ({what}):")
        return out + [f"  {line}" for line in self.comparison.lines()]


def _named_root(workflow_dir: Path, name: str) -> Path:
    """A run id under `runs/` (a bare name), else a run folder's path."""
    if "/" not in name and name not in (".", ".."):
        return workflow_dir / "runs" / name
    return Path(name)


def _load_step_run(root: Path) -> FinishedStep:
    run = load_finished(root)
    if not isinstance(run, FinishedStep):
        raise ConfigError(
            f"{root} is a whole-workflow test run; give its step's run "
            "(runs/test-<id>/steps/<n>-<step>)"
        )
    return run


def check_named(workflow_dir: Path, against: str) -> None:
    """Before the step runs: a named baseline must be a readable run of one step."""
    if against != LAST_PASSING:
        _load_step_run(_named_root(workflow_dir, against))


def _last_passing(workflow_dir: Path, verification: Verification) -> history.HistoryEntry | None:
    passing = [
        e
        for e in history.read(workflow_dir, verification.step_id)
        if e.passed and e.run_id != verification.run_id
    ]
    return passing[-1] if passing else None


def verify_against(
    workflow_dir: Path | str, verification: Verification, against: str
) -> VerifiedAgainst:
    """The verification with its run compared against `against` (`last-passing` or a
    run); nothing to compare against is said in `not_compared`, never raised."""
    wf = Path(workflow_dir).absolute()
    out = VerifiedAgainst(verification=verification, against=against)
    if against == LAST_PASSING:
        entry = _last_passing(wf, verification)
        if entry is None:
            out.not_compared = (
                f"no passing verification of {verification.step_id} to compare against "
                "(nothing compared; the verdict stands)"
            )
            return out
        baseline = wf / "runs" / entry.run_id
        out.baseline_run = entry.run_id
        where = f"the last passing verification ({entry.run_id}, {entry.at:%Y-%m-%d %H:%M} UTC)"
    else:
        baseline = _named_root(wf, against)
        where = f"run {against}"
    try:
        comparison = compare_finished(
            _load_step_run(baseline), _load_step_run(wf / "runs" / verification.run_id)
        )
    except ConfigError as exc:
        out.not_compared = f"{where} cannot be compared: {exc} (the verdict stands)"
        return out
    assert isinstance(comparison, RunComparison)
    out.baseline_run, out.comparison = comparison.run_a, comparison
    return out
