"""Two whole-workflow test runs compared step by step (`sandbox diff` of two chains).

Steps are aligned by step id (an id is unique in a workflow, and a chain may run a
different slice of it: `--from`, `--to`, a step skipped after a failure). A step in
one chain only is named; a step that ran in both is compared as one step's two runs
are (`sandbox.verify.diff`: ledger, DB diff, files, egress, status, and each of its
expectations when both chains were verified); a step that ran in one only says so.
Then the chain's own parts: its status, its order of steps, the DB diff of the real
DB against the copy the chain left, and the chain-wide expectations. The text leads
with the first step that diverged, named. Both chains' logs (and every step's that
ran) must be sealed, as in verify, gate and report.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from sandbox.contracts.errors import ConfigError
from sandbox.contracts.workflow_record import ChainStep
from sandbox.verify.diff import (
    ExpectationDifference,
    FieldDifference,
    RowDifference,
    RunComparison,
    compare_db,
    compare_db_summaries,
    compare_expectations,
    compare_runs,
    expectation_lines,
    field_lines,
    row_line,
    summarized,
    summary_line,
)
from sandbox.verify.finished import FinishedChain, FinishedStep
from sandbox.verify.seal import unsealed
from sandbox.verify.workflow_verification import WorkflowVerification


class StepComparison(BaseModel):
    """One step of the two chains: where it stood in each (None: not in that chain),
    its state there, and its two runs compared when it ran in both."""

    step_id: str
    index_a: int | None = None
    index_b: int | None = None
    state_a: str | None = None  # passed, failed, skipped, ...; None: not in that chain
    state_b: str | None = None
    comparison: RunComparison | None = None
    not_compared: str = ""  # why its runs were not compared (when it is in both chains)

    @property
    def same(self) -> bool:
        if self.comparison is not None:
            return self.comparison.same
        return self.state_a == self.state_b

    def differences(self) -> list[str]:
        """Its differences, each line naming the step."""
        name = f"step {self.step_id}"
        if self.index_a is None:
            return [f"{name}: only in B (step {self.index_b}, {self.state_b})"]
        if self.index_b is None:
            return [f"{name}: only in A (step {self.index_a}, {self.state_a})"]
        if self.comparison is None:
            if self.state_a == self.state_b:
                return []
            return [f"{name}: {self.state_a} -> {self.state_b} ({self.not_compared})"]
        return [f"{name}: {line}" for line in self.comparison.differences()]


class ChainComparison(BaseModel):
    """Two finished whole-workflow test runs compared; empty lists mean no difference."""

    kind: Literal["workflow"] = "workflow"
    run_a: str
    run_b: str
    workflow_a: str
    workflow_b: str
    steps: list[StepComparison] = Field(default_factory=list)  # A's order, then B's own
    fields: list[FieldDifference] = Field(default_factory=list)  # the chain's status, order
    db: list[RowDifference] = Field(default_factory=list)  # the chain's DB diffs, row by row
    db_summary: tuple[list[str], list[str]] | None = None
    expectations: list[ExpectationDifference] = Field(default_factory=list)  # the chain's
    expectations_compared: bool = False

    @property
    def same(self) -> bool:
        return not (
            any(not s.same for s in self.steps)
            or self.fields
            or self.db
            or self.db_summary
            or self.expectations
        )

    @property
    def changed_steps(self) -> list[str]:
        """The steps that differ, in the chains' order."""
        return [s.step_id for s in self.steps if not s.same]

    def differences(self) -> list[str]:
        """Step by step in the chains' order, then the chain's own parts."""
        body = [line for s in self.steps for line in s.differences()]
        body += [f"chain {line}" for line in field_lines(self.fields)]
        body += [f"chain {row_line(r)}" for r in self.db]
        if self.db_summary is not None and not self.db:
            body.append(f"chain {summary_line(self.db_summary)}")
        body += [f"chain {line}" for line in expectation_lines(self.expectations)]
        return body

    def notes(self) -> list[str]:
        notes = {
            f"note: step {s.step_id}: {n.removeprefix('note: ')}"
            for s in self.steps
            if s.comparison is not None
            for n in s.comparison.notes()
            if "expectations not compared" not in n
        }
        out = sorted(notes)
        if not self.expectations_compared:
            out.append("note: expectations not compared (a chain was not verified)")
        return out

    def lines(self) -> list[str]:
        """For people, terminal-safe: the first divergence first (naming its step)."""
        head = [
            f"A: workflow test run {self.run_a} of {self.workflow_a}",
            f"B: workflow test run {self.run_b} of {self.workflow_b}",
        ]
        return summarized(head, self.differences(), self.notes())


def _step_run(chain: FinishedChain, entry: ChainStep) -> FinishedStep | None:
    ev = chain.steps.get(entry.step_id) if entry.run_id is not None else None
    return None if ev is None else FinishedStep(ev.run_root, ev.record, ev)


def _compare_step(
    step_id: str,
    a: FinishedChain,
    ea: ChainStep | None,
    b: FinishedChain,
    eb: ChainStep | None,
    verdicts: tuple[WorkflowVerification, WorkflowVerification] | None,
) -> StepComparison:
    out = StepComparison(
        step_id=step_id,
        index_a=ea.index if ea is not None else None,
        index_b=eb.index if eb is not None else None,
        state_a=ea.status.value if ea is not None else None,
        state_b=eb.status.value if eb is not None else None,
    )
    if ea is None or eb is None:
        return out
    run_a, run_b = _step_run(a, ea), _step_run(b, eb)
    if run_a is None or run_b is None:
        which = " and ".join(n for n, r in (("A", run_a), ("B", run_b)) if r is None)
        out.not_compared = f"no readable run of it in {which}"
        return out
    comparison = compare_runs(run_a, run_b)
    if verdicts is not None:
        results = [next((s.results for s in v.steps if s.step_id == step_id), []) for v in verdicts]
        comparison.expectations = compare_expectations(results[0], results[1])
        comparison.expectations_compared = True
    out.comparison = comparison
    return out


def compare_chains(a: FinishedChain, b: FinishedChain) -> ChainComparison:
    """Two finished whole-workflow runs compared step by step (both must be sealed)."""
    for label, run in (("A", a), ("B", b)):
        if why := unsealed(run.record):
            raise ConfigError(f"run {label} ({run.run_root}): {why}; not compared")
    ra, rb = a.record, b.record
    by_a = {e.step_id: e for e in ra.steps}
    by_b = {e.step_id: e for e in rb.steps}
    verdicts = (
        (a.verification, b.verification)
        if a.verification is not None and b.verification is not None
        else None
    )
    ids = list(by_a) + [s for s in by_b if s not in by_a]
    steps = [_compare_step(s, a, by_a.get(s), b, by_b.get(s), verdicts) for s in ids]
    order_a, order_b = [e.step_id for e in ra.steps], [e.step_id for e in rb.steps]
    fields = [
        FieldDifference(name=name, a=va, b=vb)
        for name, va, vb in (
            ("status", ra.status.value, rb.status.value),
            ("steps", " -> ".join(order_a), " -> ".join(order_b)),
        )
        if va != vb
    ]
    return ChainComparison(
        run_a=ra.id,
        run_b=rb.id,
        workflow_a=ra.workflow_name,
        workflow_b=rb.workflow_name,
        steps=steps,
        fields=fields,
        db=compare_db(ra.db_diff, rb.db_diff),
        db_summary=compare_db_summaries(ra.db_diff, rb.db_diff),
        expectations=(
            compare_expectations(verdicts[0].chain, verdicts[1].chain) if verdicts else []
        ),
        expectations_compared=verdicts is not None,
    )
