"""The exit codes of the `sandbox` command: one meaning per code, the same for every command.

A controller in any language branches on these, so a code never changes meaning and a
new situation gets a new code. `EXIT_CODES` is the one table: the CLI returns its codes,
errors carry theirs (`sandbox.contracts.errors`), and the documentation's table is
generated from it (`markdown_table`). The `kind` of an error printed in JSON mode is
the code's lower-case name.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    REFUSED = 3
    CONFIG = 4
    ENVIRONMENT = 5
    INTERNAL = 6
    RUN_ERROR = 7
    INTERRUPTED = 130

    @property
    def kind(self) -> str:
        """The error kind said in JSON mode (`{"error": {"kind": ...}}`)."""
        return self.name.lower()


EXIT_CODES: Final[dict[ExitCode, str]] = {
    ExitCode.OK: (
        "done: the step (every step of a chain) passed, the verification held, the gate holds, "
        "every doctor check passed, or the command did what it was asked"
    ),
    ExitCode.FAILED: (
        "the answer is no: the step failed, timed out, was killed or went over a quota; "
        "the expectations did not hold; the gate is blocked; a doctor check failed"
    ),
    ExitCode.USAGE: "usage error: an unknown command or option, a missing or conflicting argument",
    ExitCode.REFUSED: (
        "refused: another run holds the workflow's lock (a test run is exclusive), "
        "so nothing was run"
    ),
    ExitCode.CONFIG: (
        "configuration error: the workflow folder, workflow.toml, host.toml, an expectations "
        "file or a run folder named on the command line is missing or invalid"
    ),
    ExitCode.ENVIRONMENT: (
        "environment error: the engine cannot be reached or refused, an image is missing, "
        "the run could not be prepared or launched"
    ),
    ExitCode.INTERNAL: "internal error: a bug in sandbox (one line on stderr to report)",
    ExitCode.RUN_ERROR: (
        "the run ended `error`: it started and its record says why it could not finish"
    ),
    ExitCode.INTERRUPTED: (
        "interrupted: ^C (SIGINT) or SIGTERM; a run that had started ends `killed` "
        "with its record written"
    ),
}


def markdown_table() -> str:
    """The exit-code table of the documentation."""
    rows = ["| code | kind | meaning |", "| ---: | --- | --- |"]
    rows += [f"| {code.value} | `{code.kind}` | {text} |" for code, text in EXIT_CODES.items()]
    return "\n".join(rows) + "\n"
