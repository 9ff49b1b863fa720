"""`sandbox lock --shared WF -- CMD`: run CMD holding the workflow's run lock.

A normal (non-test) run of a workflow takes the lock shared, so a test run, which needs
it alone, is refused (exit 3) while CMD runs; normal runs share it with each other. The
protocol is `sandbox/prepare/lock.spec.md`. CMD inherits the locked file descriptor, as
with flock(1): the lock is held until CMD and this process have both ended, so a killed
wrapper never lets a test run in beside a CMD that still runs. SIGTERM and SIGHUP are
passed on to CMD; ^C at a terminal reaches CMD by itself. The exit code is CMD's own
(128+N when a signal N ended it, 126 when it cannot be executed, 127 when it is not
found); a refused lock is 3, a bad lock folder 4.

On a fleet (a host config with `placement = "scheduler"`) the file lock keeps out only
this host's runs, so the holder also takes the workflow's Lease on the cluster (a
shared Lease of its own, or the exclusive one: `backends/kubernetes/lease.spec.md`),
renewed while CMD runs and deleted when it ends: test runs on every node are kept out,
refused the same way (exit 3). The Lease is the wrapper's: a wrapper killed outright
stops renewing it, and it expires while CMD may still run.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from sandbox.contracts.errors import UsageError

NOT_EXECUTABLE = 126
NOT_FOUND = 127


def cmd_lock(args: argparse.Namespace) -> int:
    from sandbox.prepare.lock import workflow_run_lock

    command: list[str] = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("give the command to run: sandbox lock --shared WF -- CMD [ARG...]")
    owner = args.owner or f"sandbox lock: {shlex.join(command)}"
    workflow_dir = Path(args.workflow_dir)
    with (
        workflow_run_lock(workflow_dir, exclusive=args.exclusive, owner=owner) as lock,
        _fleet_lease(args, workflow_dir, owner),
    ):
        return _run_holding(command, lock.fileno())


@contextlib.contextmanager
def _fleet_lease(args: argparse.Namespace, workflow_dir: Path, owner: str) -> Iterator[None]:
    """The workflow's Lease on the fleet's cluster while held; nothing off a fleet."""
    from sandbox.contracts.hostconfig import load_host_config

    settings = load_host_config(getattr(args, "host_config", None)).backend
    if settings.kind != "kubernetes" or settings.placement != "scheduler":
        yield
        return
    from sandbox.backends.choose import needs_client

    with needs_client():
        from sandbox.backends.kubernetes.fleet import claim_path
        from sandbox.backends.kubernetes.lease import (
            SharedLease,
            WorkflowLease,
            default_holder,
        )
        from sandbox.backends.kubernetes.podrun import connect
    workflow = claim_path(settings, workflow_dir)
    api = connect(settings)
    kind = WorkflowLease if args.exclusive else SharedLease
    lease = kind(api, settings.namespace, workflow, default_holder(owner))
    try:
        with lease:
            yield
    finally:
        api.close()


def _run_holding(command: list[str], lock_fd: int) -> int:
    """CMD with the lock's descriptor, waited for; its exit code."""
    try:
        child = subprocess.Popen(command, pass_fds=(lock_fd,))
    except FileNotFoundError:
        return NOT_FOUND
    except PermissionError:
        return NOT_EXECUTABLE

    def pass_on(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, pass_on),
        signal.SIGHUP: signal.signal(signal.SIGHUP, pass_on),
        # A terminal's ^C goes to CMD as well (same process group): CMD decides.
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
    }
    try:
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code
