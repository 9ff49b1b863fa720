"""A verification: the verdict over every expectation, and a short digest of the run.

`verification.json` in the test run's folder, written by the host after the run
(atomically, like the record) and never mounted into any container.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sandbox.contracts.record import ContentHash, Walls, write_json_atomic
from sandbox.contracts.recording import ReplaySummary
from sandbox.contracts.status import VERIFICATION_FILE
from sandbox.verify.check import ExpectationResult
from sandbox.verify.evidence import Evidence

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "contracts" / "verification.schema.json"
MAX_FILES_LISTED = 20


class RunDigest(BaseModel):
    """What the run did, in a few lines: stubbed calls, refusals, DB changes, files."""

    status: str = Field(description="The run's status.")
    exit_code: int | None = Field(default=None, description="The step's exit code.")
    stubbed: dict[str, int] = Field(default_factory=dict, description="Stubbed calls per tool.")
    refused: dict[str, int] = Field(default_factory=dict, description="Refused calls per tool.")
    db: list[str] = Field(default_factory=list, description="The DB diff in lines.")
    files_created: list[str] = Field(
        default_factory=list, description="Files created (the first ones)."
    )
    files_changed: list[str] = Field(
        default_factory=list, description="Files changed (the first ones)."
    )
    files_deleted: list[str] = Field(
        default_factory=list, description="Files deleted (the first ones)."
    )

    def lines(self) -> list[str]:
        def counted(c: dict[str, int]) -> str:
            return ", ".join(f"{k} x{n}" for k, n in c.items()) or "none"

        out = [
            f"run: {self.status}, exit code {self.exit_code}",
            f"stubbed (would have run): {counted(self.stubbed)}",
        ]
        if self.refused:
            out.append(f"refused: {counted(self.refused)}")
        out.append("db: " + "; ".join(self.db or ["no changes"]))
        files = [
            f"{label} {', '.join(names)}"
            for label, names in (
                ("created", self.files_created),
                ("changed", self.files_changed),
                ("deleted", self.files_deleted),
            )
            if names
        ]
        out.append("files: " + ("; ".join(files) or "no changes"))
        return out


def _call_name(tool: str, method: str, host: str) -> str:
    return f"egress {method} {host}" if tool == "http" and (method or host) else tool


def digest_of(ev: Evidence) -> RunDigest:
    rec = ev.record
    stubbed: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    for call in ev.calls:
        name = _call_name(call.line.tool, call.method, call.host)
        if call.line.decision == "stub":
            stubbed[name] += 1
        elif call.line.decision == "refuse":
            refused[name] += 1
    return RunDigest(
        status=rec.status.value,
        exit_code=rec.exit_code,
        stubbed=dict(stubbed),
        refused=dict(refused),
        db=rec.db_diff.summary_lines() if rec.db_diff is not None else [],
        files_created=rec.files.created[:MAX_FILES_LISTED],
        files_changed=rec.files.changed[:MAX_FILES_LISTED],
        files_deleted=rec.files.deleted[:MAX_FILES_LISTED],
    )


class Verification(BaseModel):
    model_config = ConfigDict(title="Verification")

    schema_version: Literal[1] = Field(default=1, description="The verification's schema version.")
    run_id: str = Field(description="The test run judged.")
    workflow_name: str = Field(description="The workflow's name.")
    step_id: str = Field(description="The step.")
    at: datetime = Field(description="When the verdict was made.")
    passed: bool = Field(description="Every expectation held.")
    content: ContentHash | None = Field(
        default=None,
        description=(
            "The step's version the run tested (the gate compares it with the version now)."
        ),
    )
    expectations_digest: str = Field(
        description=("A digest of the expectations judged (the gate needs the current ones).")
    )
    results: list[ExpectationResult] = Field(description="One result per expectation, in order.")
    digest: RunDigest = Field(description="What the run did, in a few lines.")
    walls: Walls | None = Field(
        default=None, description="The run's walls (the gate accepts only every wall)."
    )  # the run's walls (the gate accepts only every wall)
    replay: ReplaySummary | None = Field(
        default=None,
        description=(
            "The recording the run's reads were answered from, and its misses; none: a "
            "live run (the gate refuses a replayed verification unless the host allows it)."
        ),
    )

    def lines(self) -> list[str]:
        held = sum(r.ok for r in self.results)
        verdict = "PASS" if self.passed else "FAIL"
        out = [
            f"verdict: {verdict}: step {self.step_id}, {held} of {len(self.results)} "
            f"expectation(s) held (test run {self.run_id})"
        ]
        if self.replay is not None:
            out += replay_lines(self.replay)
        out += [f"  {r.line()}" for r in self.results]
        out.append("digest:")
        out += [f"  {line}" for line in self.digest.lines()]
        if self.content is not None:
            out.append(f"content hash: {self.content.digest[:16]}")
        return out


def replay_lines(replay: ReplaySummary) -> list[str]:
    """How a replayed run says so: first, with every miss it had (a few named)."""
    out = [
        f"REPLAYED: reads answered from the recording of {replay.run_id} "
        f"(index {replay.index_sha256[:16]}): {replay.hits} hit(s), {replay.misses} miss(es), "
        f"misses {'went live' if replay.miss_mode == 'live' else 'stubbed'}"
    ]
    for miss in replay.misses_named[:10]:
        out.append(f"  replay miss: {miss.what}" + (" (went live)" if miss.went_live else ""))
    if replay.misses > 10:
        out.append(f"  +{replay.misses - 10} more replay miss(es)")
    return out


def verification_json_schema() -> str:
    """The published schema of `verification.json` (and `sandbox verify --json`)."""
    return json.dumps(Verification.model_json_schema(), indent=2, sort_keys=True) + "\n"


def write_verification(run_root: Path, verification: BaseModel) -> Path:
    """Save a step's or a chain's verdict beside its run (the same file name for both)."""
    path = run_root / VERIFICATION_FILE
    write_json_atomic(path, verification.model_dump_json(indent=2) + "\n")
    return path
