"""A run's status and the names of the files its record is kept in.

Apart from `record` (the pydantic models) so that what only needs a status or a file
name (the CLI's exit codes, `layout`, a folder listing) loads no pydantic: the CLI
imports this module at every start, the record's models only when it reads or makes one.
`sandbox.contracts.record` re-exports all three names.
"""

from __future__ import annotations

from enum import StrEnum

RECORD_FILE = "test_mode.json"
ACTIONS_FILE = "test_mode_actions.jsonl"
VERIFICATION_FILE = "verification.json"
REPORT_FILE = "report.html"  # `sandbox report` writes it there unless told otherwise


class RunStatus(StrEnum):
    """`running` is only ever seen while the runner lives; `sandbox gc` turns an
    orphaned `running` record into `killed`."""

    RUNNING = "running"
    PASSED = "passed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    REFUSED = "refused"
    ERROR = "error"
    KILLED = "killed"
    QUOTA = "quota"
