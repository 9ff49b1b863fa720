"""A workflow verification: one verdict over a whole chain, per step and for the chain.

`verification.json` in the chain's run folder (`kind: workflow`), written by the
host after the chain ended (atomically) and never mounted into any container.
Its evidence cites the chain's action log (`test_mode_actions.jsonl` in the run
folder: every step's lines in order), each citation naming its step. The
published schema is `sandbox/contracts/workflow_verification.schema.json`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sandbox.contracts.record import ContentHash, Walls
from sandbox.verify.check import ExpectationResult
from sandbox.verify.verification import RunDigest, write_verification

SCHEMA_PATH = (
    Path(__file__).resolve().parents[1] / "contracts" / "workflow_verification.schema.json"
)


class StepVerdict(BaseModel):
    """One step of the chain: its expectations' results against its run in the chain."""

    index: int
    step_id: str
    run_id: str | None = None
    status: str  # the step's state in the chain (a run status, or skipped)
    passed: bool
    content: ContentHash | None = None
    walls: Walls | None = None  # its run's walls
    # When the file took the step's own expectations (`own = true`): their digest, and
    # whether they held (alone, as `sandbox verify` of the step judges them).
    own_expectations_digest: str | None = None
    own_passed: bool | None = None
    results: list[ExpectationResult] = Field(default_factory=list)
    digest: RunDigest | None = None


class ChainDigest(BaseModel):
    """What the chain did, in a few lines."""

    status: str
    steps: list[str] = Field(default_factory=list)  # "bid-pick-job passed", ...
    stubbed: dict[str, int] = Field(default_factory=dict)  # tool -> calls, across the chain
    db: list[str] = Field(default_factory=list)

    def lines(self) -> list[str]:
        stubbed = ", ".join(f"{k} x{n}" for k, n in self.stubbed.items()) or "none"
        return [
            f"chain: {self.status} ({'; '.join(self.steps)})",
            f"stubbed across the chain (would have run): {stubbed}",
            "db (real DB against the chain's copy): " + "; ".join(self.db or ["no changes"]),
        ]


class WorkflowVerification(BaseModel):
    model_config = ConfigDict(title="WorkflowVerification")

    schema_version: Literal[1] = 1
    kind: Literal["workflow"] = "workflow"
    run_id: str
    workflow_name: str
    at: datetime
    passed: bool
    expectations_file: str
    expectations_digest: str
    from_step: str | None = None
    to_step: str | None = None
    chain_steps: list[str]
    steps: list[StepVerdict]
    chain: list[ExpectationResult]
    digest: ChainDigest

    @property
    def failed(self) -> list[str]:
        """The labels that did not hold, each with its step (`bid-submit: ...`)."""
        out = [f"{s.step_id}: {r.label}" for s in self.steps for r in s.results if not r.ok]
        return out + [f"chain: {r.label}" for r in self.chain if not r.ok]

    def lines(self) -> list[str]:
        results = [r for s in self.steps for r in s.results] + self.chain
        held = sum(r.ok for r in results)
        verdict = "PASS" if self.passed else "FAIL"
        out = [
            f"verdict: {verdict}: workflow {self.workflow_name} "
            f"({' -> '.join(self.chain_steps)}), {held} of {len(results)} expectation(s) "
            f"held (workflow test run {self.run_id}, {self.expectations_file})"
        ]
        for step in self.steps:
            if not step.results:
                continue
            mark = "PASS" if step.passed else "FAIL"
            out.append(f"step {step.index} {step.step_id}: {mark} ({step.status})")
            out += [f"  {r.line()}" for r in step.results]
        out.append(f"chain: {'PASS' if all(r.ok for r in self.chain) else 'FAIL'}")
        out += [f"  {r.line()}" for r in self.chain]
        out.append("digest:")
        out += [f"  {line}" for line in self.digest.lines()]
        return out


def workflow_verification_json_schema() -> str:
    """The published schema of a workflow's `verification.json` (and its `--json`)."""
    return json.dumps(WorkflowVerification.model_json_schema(), indent=2, sort_keys=True) + "\n"


def write_workflow_verification(run_root: Path, verification: WorkflowVerification) -> Path:
    return write_verification(run_root, verification)
