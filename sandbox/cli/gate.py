"""`gate`: exit 0 when the step's (or the chain's) current version is verified, 1 when not.

The reason is said either way (a line, or `{"ok": ..., "reason": ...}` with `--json`);
a combination of arguments that names no one thing to gate is a usage error (2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sandbox.cli.output import emit, say_line
from sandbox.contracts.errors import UsageError
from sandbox.contracts.exitcodes import ExitCode


def cmd_gate(args: argparse.Namespace) -> int:
    from sandbox.verify.gate import gate, gate_workflow

    if args.workflow is not None:
        if args.step_id is not None or args.allow_no_effects:
            raise UsageError("--workflow gates a chain: give no step and no --allow-no-effects")
        result = gate_workflow(
            Path(args.workflow_dir),
            args.workflow,
            from_step=args.from_step,
            to_step=args.to_step,
            host_config=args.host_config,
        )
    elif args.step_id is None:
        raise UsageError("give a step to gate, or --workflow FILE to gate the chain")
    elif args.from_step is not None or args.to_step is not None:
        raise UsageError("--from and --to go with --workflow")
    else:
        result = gate(
            Path(args.workflow_dir),
            args.step_id,
            allow_no_effects=args.allow_no_effects,
            host_config=args.host_config,
        )
    if args.json:
        emit({"ok": result.ok, "reason": result.reason})
    else:
        say_line(("gate: ok: " if result.ok else "gate: blocked: ") + result.reason)
    return ExitCode.OK if result.ok else ExitCode.FAILED
