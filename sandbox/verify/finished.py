"""One reader of a finished test run: its record, action log and saved verification, loaded once.

Every output of a run folder renders the object `load_run` returns (`sandbox show`
and its JSON, the verify verdicts, JUnit, the HTML report, the run-to-run diff), so a
folder is read by one code path, once per command. What the reading guarantees is
what each file's reader guarantees (`sandbox.verify.evidence`): nothing is opened
through a link, the log is size-capped and every line validated, and no size, name
or path from inside the sandbox is trusted. A verification file that cannot be read
is absent (`verification_error` says why): a half-read verdict is never shown.
Whether the record may be judged (its log sealed) is the caller's rule
(`sandbox.verify.seal`): `show` warns, verify, gate and report refuse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from sandbox.contracts.errors import ConfigError
from sandbox.contracts.layout import WorkflowRunLayout
from sandbox.contracts.record import ACTIONS_FILE, TestRunRecord, read_record
from sandbox.contracts.status import VERIFICATION_FILE
from sandbox.contracts.workflow_record import StepState, WorkflowRunRecord, read_any_record
from sandbox.verify.evidence import (
    Call,
    ChainEvidence,
    Evidence,
    GroupFolder,
    fold_changes,
    read_calls,
)
from sandbox.verify.verification import Verification
from sandbox.verify.workflow_verification import WorkflowVerification

_Saved = TypeVar("_Saved", bound=BaseModel)


def _read_saved(run_root: Path, model: type[_Saved]) -> tuple[_Saved | None, str]:
    """The verdict saved beside a run, read without following a link: (it, "") or
    (None, why not); an absent file is (None, "")."""
    try:
        fd = os.open(run_root / VERIFICATION_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"{VERIFICATION_FILE} unreadable: {exc.strerror}"
    try:
        with os.fdopen(fd, encoding="utf-8") as handle:
            return model.model_validate_json(handle.read()), ""
    except (OSError, ValueError) as exc:
        return None, f"{VERIFICATION_FILE} unreadable: {str(exc).splitlines()[0]}"


def _evidence(run_root: Path, record: TestRunRecord) -> tuple[Evidence, int]:
    """A step's evidence and the number of lines of its log (its log read once)."""
    log = read_calls(run_root / ACTIONS_FILE)
    return Evidence(run_root, record, log.calls, log.malformed, log.truncated), log.lines


@dataclass(frozen=True)
class FinishedStep:
    """A finished test run of one step."""

    run_root: Path
    record: TestRunRecord
    evidence: Evidence
    verification: Verification | None = None
    verification_error: str = ""

    @property
    def calls(self) -> list[Call]:
        return self.evidence.calls

    @classmethod
    def load(cls, run_root: Path) -> FinishedStep:
        return _load_as(run_root, cls)


@dataclass(frozen=True)
class FinishedChain:
    """A finished whole-workflow test run: its record, each step that has a readable
    run folder (its evidence, lines numbered as in the chain's log) and the chain's."""

    run_root: Path
    record: WorkflowRunRecord
    steps: dict[str, Evidence] = field(default_factory=dict)
    chain: ChainEvidence = field(default_factory=ChainEvidence)
    verification: WorkflowVerification | None = None
    verification_error: str = ""

    @property
    def calls(self) -> list[Call]:
        return self.chain.calls

    @classmethod
    def load(cls, run_root: Path) -> FinishedChain:
        return _load_as(run_root, cls)


FinishedRun = FinishedStep | FinishedChain
_Kind = TypeVar("_Kind", FinishedStep, FinishedChain)


def _load_as(run_root: Path, kind: type[_Kind]) -> _Kind:
    run = load_run(run_root)
    if not isinstance(run, kind):
        what, other = (
            ("one step", "a workflow") if kind is FinishedStep else ("a workflow", "one step")
        )
        raise ConfigError(f"{run_root} is a test run of {other}, not of {what}")
    return run


def load_run(run_root: Path) -> FinishedRun:
    """The run folder read once. The record must be readable (OSError, ValueError
    otherwise: there is no run to show); the rest is what could be read."""
    record = read_any_record(run_root)
    if isinstance(record, WorkflowRunRecord):
        return _load_chain(run_root, record)
    evidence, _ = _evidence(run_root, record)
    verification, error = _read_saved(run_root, Verification)
    return FinishedStep(run_root, record, evidence, verification, error)


def _load_chain(run_root: Path, record: WorkflowRunRecord) -> FinishedChain:
    layout = WorkflowRunLayout(run_root.parent.parent, run_root.name)
    steps: dict[str, Evidence] = {}
    chain = ChainEvidence(
        db_diff=record.db_diff,
        no_db=record.db is None and record.db_diff is None,
        status=record.status,
        reason=record.reason,
    )
    offset = 0
    for entry in record.steps:
        if entry.run_id is None:
            continue
        root = layout.step(entry.index, entry.step_id, entry.group).root
        try:
            ev, lines = _evidence(root, read_record(root))
        except (OSError, ValueError):
            continue  # no readable record: its expectations fail as not run
        ev.calls = [
            Call(c.lineno + offset, c.line, c.raw, c.outcome, in_step=entry.step_id)
            for c in ev.calls
        ]
        # Only a step that ended had its lines joined onto the chain's log.
        if entry.status not in (StepState.RUNNING, StepState.PENDING):
            offset += lines
        steps[entry.step_id] = ev
        chain.calls += ev.calls
        chain.malformed_lines += ev.malformed_lines
        chain.log_truncated = chain.log_truncated or ev.log_truncated
        chain.log_full = chain.log_full or ev.log_full
    for group in dict.fromkeys(e.group for e in record.steps):
        ran = [steps[e.step_id] for e in record.steps if e.group == group and e.step_id in steps]
        if not ran:
            continue
        last = ran[-1]
        chain.groups[group] = GroupFolder(
            group=group,
            files=fold_changes([ev.record.files for ev in ran]),
            root=last.run_root / last.record.group,
        )
    verification, error = _read_saved(run_root, WorkflowVerification)
    return FinishedChain(run_root, record, steps, chain, verification, error)
