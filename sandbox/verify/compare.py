"""`sandbox.compare` / `sandbox diff RUN_A RUN_B`: two finished test runs compared.

Each folder is read once by the one reader of a finished run (`sandbox.verify.finished`);
two runs of a step are compared by `sandbox.verify.diff`, two whole-workflow runs step
by step by `sandbox.verify.chaindiff`. A run of one step and a whole-workflow run are
not compared with each other (a clear error: which step of the chain is meant is the
caller's to say, by giving that step's run folder, `runs/test-<id>/steps/<n>-<step>`).
"""

from __future__ import annotations

from pathlib import Path

from sandbox.contracts.errors import ConfigError
from sandbox.verify.chaindiff import ChainComparison, compare_chains
from sandbox.verify.diff import RunComparison, compare_runs
from sandbox.verify.finished import FinishedChain, FinishedRun, FinishedStep, load_run

Comparison = RunComparison | ChainComparison


def load_finished(run_root: Path | str | FinishedRun) -> FinishedRun:
    """A run folder read for comparing (ConfigError when it has no readable record)."""
    if isinstance(run_root, FinishedStep | FinishedChain):
        return run_root
    root = Path(run_root)
    try:
        return load_run(root)
    except FileNotFoundError:
        raise ConfigError(f"no test_mode.json in {root}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{root}/test_mode.json unreadable: {str(exc).splitlines()[0]}") from None


def compare_finished(a: FinishedRun, b: FinishedRun) -> Comparison:
    """Two loaded runs compared: of one step each, or whole workflows each."""
    if isinstance(a, FinishedStep) and isinstance(b, FinishedStep):
        return compare_runs(a, b)
    if isinstance(a, FinishedChain) and isinstance(b, FinishedChain):
        return compare_chains(a, b)
    chain, step = ("A", "B") if isinstance(a, FinishedChain) else ("B", "A")
    raise ConfigError(
        f"run {chain} is a whole-workflow test run and run {step} a run of one step; "
        f"give the chain's step run (runs/test-<id>/steps/<n>-<step>) to compare with it"
    )


def compare(a: Path | str | FinishedRun, b: Path | str | FinishedRun) -> Comparison:
    """`sandbox.compare`: two test runs (run folders, or loaded runs) compared; a
    `RunComparison` for two runs of a step, a `ChainComparison` for two chains."""
    return compare_finished(load_finished(a), load_finished(b))
