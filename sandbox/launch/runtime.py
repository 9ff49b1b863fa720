"""The step's OCI runtime: runc (the default) or gVisor's runsc, and what runsc needs.

Under runsc the step talks to gVisor's sentry, a user-space kernel, instead of the
host's: a kernel bug the step could reach is the sentry's, and only the sentry's own
narrow set of host calls reaches the host. What that changes for a test run, and how
each is handled here, as measured on a runsc engine:

- Network: the engine must register runsc with `--network=host` (passthrough). The
  step joins the guard's network namespace, and the sentry uses the host kernel's
  sockets there, so the guard's firewall filters them. gVisor's own netstack cannot
  start on kernels from about 6.11, and would keep the guard's loopback out of reach.
- Uids: the firewall sees the sentry's host uid (0), never the step's; it accepts
  only the guard's uid (`sandbox.launch.firewall` refuses uid 0), so the guard must
  stay on runc.
- Pids: the ptrace platform needs a host process per address space, counted in the
  container's pids limit (about 40 for an idle sandbox). The limit is raised to at
  least `PIDS_FLOOR`; a fork past it ends the whole sandbox (the step exits 2),
  where under runc the step's fork gets EAGAIN.
- Seccomp: the engine must register runsc with `--oci-seccomp`, or the sentry never
  applies the profile (it would emulate `unshare`, `ptrace` instead of refusing
  them). The profile's `clone3 -> ENOSYS` rule comes back as EPERM under runsc, so
  glibc never falls back to `clone` and no thread starts: `profile_for` allows
  clone3 (the sentry answers it with ENOSYS itself). runsc looks the profile's names
  up in the sentry's own syscall table (`runsc help syscalls`) and silently drops a
  name it does not know, and that table calls 270 `pselect`, not `pselect6`: the
  call fell to the default EPERM, so Python's `select.select` failed and the
  executor's server thread, waiting for the guard's first call, ended without a
  word (every executor-routed tool call then hung). `profile_for` gives each rule
  naming such a call the sentry's name too. The executor's preflight then proves the
  profile is in force (a user namespace is refused) before the step runs.
- Memory: the step sees no cgroup files under gVisor, and the executor's rusage is the
  sentry's account of processes the step controls: the record's peak comes from the
  engine alone, the container's cgroup read on the host while it runs
  (`sandbox.backends.docker.hostcgroup`; the sandbox's own ~16 MiB included), or the
  engine's samples, and `resources.peak_memory_source` says which.
- MCP servers stay on runc: their one way out is a unix socket of the guard's, which
  a gVisor sandbox reaches only with runsc's `--host-uds`, a wider opening than the
  run needs; they have no network, no capability and their own uid (mapped like the
  step's and the guard's under userns-remap).
"""

from __future__ import annotations

import json
from typing import Any

from sandbox.contracts.config import StepRuntime

RUNSC = "runsc"
# The engine's runtime named "runsc" must pass these to runsc (see the module docstring).
RUNSC_REQUIRED_ARGS = ("--network=host", "--oci-seccomp")
PIDS_FLOOR = 256
# Linux x86_64 names the sentry's syscall table knows by another name, for the same
# number (`runsc help syscalls`). A runsc whose table uses the Linux name drops the
# alias as unknown, so naming both is right for either.
SENTRY_SYSCALL_NAMES = {"pselect6": "pselect"}
# Why the Kubernetes backend refuses runsc (measured: docs/dev/gvisor-on-kubernetes.md).
# A RuntimeClass is per Pod, so the firewall init container and the guard would share
# the step's gVisor sandbox: under runsc's host network the init container cannot
# install the firewall (the sentry offers neither nftables nor iptables' tables), and
# the node's firewall would see the sentry's uid 0 for the guard and the step alike,
# so it could not let the guard out and keep the step in. Never run weaker: refuse.
POD_RUNSC_REFUSAL = (
    'step_runtime = "runsc" is not available on the Kubernetes backend: a RuntimeClass puts '
    "the whole Pod (the firewall init container and the guard with the step) under gVisor, "
    "where the Pod's firewall cannot be installed nor tell the guard's traffic from the "
    "step's; run the step under gVisor on the Docker backend (an engine with a runsc "
    "runtime), or under runc on the cluster"
)


def engine_runtime(runtime: StepRuntime) -> str | None:
    """The engine's runtime name for the step container (None: the engine's default)."""
    return RUNSC if runtime == RUNSC else None


def step_pids(runtime: StepRuntime, pids: int) -> int:
    return max(pids, PIDS_FLOOR) if runtime == RUNSC else pids


def profile_for(runtime: StepRuntime, profile_json: str) -> str:
    """The step's seccomp profile for this runtime: for runsc, clone3 is allowed (the
    sentry answers ENOSYS itself, so glibc falls back to clone), and a rule naming a
    call the sentry knows by another name (`SENTRY_SYSCALL_NAMES`) names it both ways;
    every other rule is the same."""
    if runtime != RUNSC:
        return profile_json
    data: dict[str, Any] = json.loads(profile_json)
    rules = []
    for rule in data["syscalls"]:
        given = rule.get("names", [])
        aliases = [SENTRY_SYSCALL_NAMES[n] for n in given if n in SENTRY_SYSCALL_NAMES]
        if aliases:
            rule = {**rule, "names": [*given, *aliases]}
        names = [n for n in rule.get("names", []) if n != "clone3"]
        if names == rule.get("names", []):
            rules.append(rule)
        elif names:
            rules.append({**rule, "names": names})
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ALLOW"})
    return json.dumps({**data, "syscalls": rules}, separators=(",", ":"))
