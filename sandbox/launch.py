"""The two containers of one test run, as data: the guard and the step.

Pure: this module decides users, mounts, environment, limits and networks from
a `RunPlan` and makes no engine calls (it only borrows the engine layer's
image and label names); `sandbox.engine` turns the specs into API calls and
`sandbox.run` decides when. Reading it top to bottom answers
"what does the step see, and what does the guard hold?".
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from sandbox import firewall
from sandbox.config import Egress, EgressEntry, Step, Workflow
from sandbox.engine import images
from sandbox.engine.containers import (
    LABEL_ROLE,
    LABEL_RUN_ID,
    LABEL_RUN_ROOT,
    LABEL_RUNNER_PID,
    LABEL_RUNNER_START,
)
from sandbox.guard.config import (
    ACTIONS_PATH,
    BRIDGE_PORT,
    CONFIG_FILE_ENV,
    CONFIG_FILE_NAME,
    DATA_DIR,
    EGRESS_PORT,
    EXEC_PORT,
    MCP_PATH,
    GuardConfig,
)
from sandbox.layout import (
    C_CA_BUNDLE,
    C_DB_PATH,
    C_PROMPT,
    GUARD_UID,
    STEP_UID,
    RunLayout,
)
from sandbox.mounts import step_mounts, workflow_mounts
from sandbox.preflight import ENV as PREFLIGHT_ENV
from sandbox.record import RunnerInfo
from sandbox.spec import ContainerSpec, Mount
from sandbox.step_exec import GUARD_WAIT_ENV

CA_BUNDLE_VARIABLES = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "PIP_CERT",
)


@dataclass(frozen=True)
class Tokens:
    """Per-run secrets: the step's bridge token and the guard's executor token."""

    bridge: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    exec: str = field(default_factory=lambda: secrets.token_urlsafe(24))


@dataclass(frozen=True)
class EgressCA:
    """The run's TLS-inspection CA as PEM text (made by the runner; see sandbox.guard.tls)."""

    cert_pem: str
    key_pem: str = field(repr=False)


@dataclass(frozen=True)
class RunPlan:
    """Everything the specs depend on, resolved before any container exists."""

    workflow_dir: Path
    workflow: Workflow
    step: Step
    layout: RunLayout
    runner: RunnerInfo
    crew: dict[str, Path]
    has_db: bool
    has_prompt: bool
    seccomp_profile: str
    upstream: str | None
    networks: list[str]
    egress: Egress
    trusted_ca_pem: str
    mcp_host_env: dict[str, dict[str, str]]
    canary: str | None = None
    canary6: str | None = None
    install_firewall: bool = True
    fsync_action_log: bool = True
    tokens: Tokens = field(default_factory=Tokens)
    egress_ca: EgressCA | None = None  # set when some allow-list entry is inspected


def egress_for_run(workflow: Workflow, extra_hosts: tuple[str, ...]) -> Egress:
    """The workflow's allow list plus the hosts added for this run only."""
    extra = [EgressEntry(host=host) for host in extra_hosts]
    return workflow.egress.model_copy(update={"allow": [*workflow.egress.allow, *extra]})


def step_user() -> tuple[int, int]:
    """A root runner hands the step a fixed unprivileged uid; others run it as themselves."""
    if os.geteuid() == 0:
        return STEP_UID, STEP_UID
    return os.getuid(), os.getgid()


def labels(plan: RunPlan, role: str) -> dict[str, str]:
    """What `sandbox gc` reads to tell an orphan from a live run's container."""
    return {
        LABEL_RUN_ID: plan.layout.run_id,
        LABEL_RUN_ROOT: str(plan.layout.root),
        LABEL_ROLE: role,
        LABEL_RUNNER_PID: str(plan.runner.pid),
        LABEL_RUNNER_START: repr(plan.runner.create_time),
    }


def guard_config(plan: RunPlan) -> GuardConfig:
    bridge = plan.workflow.bridge
    return GuardConfig(
        run_id=plan.layout.run_id,
        workflow=plan.workflow.name,
        step=plan.step.id,
        bridge_token=plan.tokens.bridge,
        exec_token=plan.tokens.exec,
        has_db=plan.has_db,
        upstream=plan.upstream,
        default_budget_s=bridge.default_budget_s,
        grace_s=bridge.grace_s,
        budgets=bridge.budgets,
        mcp_servers=plan.workflow.mcp_servers,
        mcp_host_env=plan.mcp_host_env,
        egress=plan.egress,
        egress_trust_pem=plan.trusted_ca_pem,
        egress_ca_pem=plan.egress_ca.cert_pem if plan.egress_ca else "",
        egress_ca_key_pem=plan.egress_ca.key_pem if plan.egress_ca else "",
        fsync_each=plan.fsync_action_log,
    )


# The guard image's own program; the entry script execs it after dropping privileges.
GUARD_COMMAND = ["/opt/guard/bin/python", "-m", "sandbox.guard"]
# What the entry script needs for its moment as root: the rules, then the drop.
GUARD_ENTRY_CAPS = ["NET_ADMIN", "SETUID", "SETGID", "SETPCAP"]


def guard_spec(plan: RunPlan) -> ContainerSpec:
    """The guard owns the network namespace and is the only uid the firewall lets out.

    It starts as root with NET_ADMIN only long enough to install the firewall, then
    runs as the guard uid with no capability in any set (see firewall.guard_entry_script).
    """
    layout = plan.layout
    stdio_servers = sum(1 for server in plan.workflow.mcp_servers if server.command is not None)
    script = firewall.guard_entry_script(GUARD_COMMAND, GUARD_UID, install=plan.install_firewall)
    return ContainerSpec(
        name=f"sandbox-{layout.run_id}-guard",
        image=images.GUARD_IMAGE,
        entrypoint=["/bin/sh", "-c", script],
        command=[],
        user="0:0",
        cap_add=GUARD_ENTRY_CAPS,
        init=False,  # tini becomes pid 1 after the drop; docker-init would stay root
        env={CONFIG_FILE_ENV: f"{DATA_DIR}/{CONFIG_FILE_NAME}"},
        mounts=[
            Mount(source=str(layout.actions), target=ACTIONS_PATH, read_only=False),
            Mount(source=str(layout.guard_dir), target=DATA_DIR, read_only=False),
            # Stdio MCP servers run in the guard; their data is the workflow's, read-only.
            *workflow_mounts(layout),
        ],
        tmpfs={"/tmp": "rw,nosuid,nodev,noexec,size=16m"},
        labels=labels(plan, "guard"),
        # Each stdio MCP server (node or Python, ~70 MB, ~12 threads) runs in here too.
        memory_bytes=(256 + 128 * stdio_servers) * 1024**2,
        pids=128 + 32 * stdio_servers,
        cpus=1.0,
        network_mode=plan.networks[0] if plan.networks else "none",
        sysctls={"net.ipv4.ping_group_range": "1 0"},
        # The step's profile fits the guard too (Python, node MCP servers): no
        # ptrace, io_uring or namespaces for the one process that may go out.
        seccomp_profile=plan.seccomp_profile,
    )


def step_env(plan: RunPlan, *, has_ca_bundle: bool) -> dict[str, str]:
    """The step's whole environment: test mode, its DB copy, and its only ways out."""
    proxy = f"http://127.0.0.1:{EGRESS_PORT}"
    env = {
        "AGENTWORKS_TEST_MODE": "1",
        "AGENTWORKS_TEST_RUN_ID": plan.layout.run_id,
        "HOME": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1",
        "AGENTWORKS_BRIDGE_URL": f"http://127.0.0.1:{BRIDGE_PORT}",
        "AGENTWORKS_BRIDGE_TOKEN": plan.tokens.bridge,
        "AGENTWORKS_MCP_URL": f"http://127.0.0.1:{BRIDGE_PORT}{MCP_PATH}",
        "HTTP_PROXY": proxy,
        "HTTPS_PROXY": proxy,
        "http_proxy": proxy,
        "https_proxy": proxy,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        # Read and removed by the executor (pid 1) before the step command starts.
        "AGENTWORKS_EXEC_PORT": str(EXEC_PORT),
        "AGENTWORKS_EXEC_TOKEN": plan.tokens.exec,
        # The step starts while its guard is still starting; the executor waits for it.
        GUARD_WAIT_ENV: f"127.0.0.1:{BRIDGE_PORT}",
        PREFLIGHT_ENV: json.dumps({"canary": plan.canary, "canary6": plan.canary6}),
    }
    if plan.has_db:
        env["DB_PATH"] = C_DB_PATH
    if plan.has_prompt:
        env["AGENTWORKS_PROMPT_FILE"] = C_PROMPT
    if has_ca_bundle:
        env.update(dict.fromkeys(CA_BUNDLE_VARIABLES, C_CA_BUNDLE))
    return env


def step_spec(plan: RunPlan, guard_id: str, *, has_ca_bundle: bool) -> ContainerSpec:
    uid, gid = step_user()
    limits = plan.workflow.limits
    return ContainerSpec(
        name=f"sandbox-{plan.layout.run_id}-step",
        image=images.STEP_IMAGE,
        command=["python3", "-m", "agentworks_exec", "--", *plan.step.argv()],
        init=False,  # the executor is pid 1 and reaps; see step_exec._reap_until_exit
        user=f"{uid}:{gid}",
        workdir=plan.layout.container_workdir,
        env=step_env(plan, has_ca_bundle=has_ca_bundle),
        mounts=step_mounts(
            plan.layout,
            plan.crew,
            has_db=plan.has_db,
            has_prompt=plan.has_prompt,
            has_ca_bundle=has_ca_bundle,
        ),
        tmpfs={"/tmp": f"rw,nosuid,nodev,size={limits.tmpfs_mb}m,mode=1777"},
        labels=labels(plan, "step"),
        memory_bytes=limits.memory_mb * 1024**2,
        pids=limits.pids,
        cpus=limits.cpus,
        seccomp_profile=plan.seccomp_profile,
        network_mode=f"container:{guard_id}",
    )
