"""The containers of one test run, as data: the guard, the step, each stdio MCP server.

Pure: this module decides users, mounts, environment, limits and networks from
a `RunPlan` and makes no engine calls (it only borrows the engine layer's
image and label names); `sandbox.backends.docker` turns the specs into API calls and
`sandbox.run.testrun` decides when. The plan itself is `sandbox.prepare.plan`'s
(its names are re-exported here). Reading it top to bottom answers "what does the
step see, what does the guard hold, and what does an MCP server get?".
"""

from __future__ import annotations

import json

from sandbox.contracts import names
from sandbox.contracts.config import McpServer
from sandbox.contracts.guardconfig import (
    ACTIONS_PATH,
    BRIDGE_PORT,
    CONFIG_FILE_ENV,
    CONFIG_FILE_NAME,
    DATA_DIR,
    EGRESS_PORT,
    EXEC_PORT,
    MCP_DIR,
    MCP_PATH,
    GuardConfig,
)
from sandbox.contracts.guardprocess import GUARD_MEMORY_BYTES
from sandbox.contracts.layout import (
    C_CA_BUNDLE,
    C_DB_PATH,
    C_MCP_CA_BUNDLE,
    C_MCP_DIR,
    C_PROMPT,
    GUARD_UID,
    MCP_EGRESS_SOCKET,
    MCP_SOCKET,
    mcp_proxy_port,
    mcp_uid,
)
from sandbox.contracts.names import (
    LABEL_MCP_SERVER,
    LABEL_ROLE,
    LABEL_RUN_ID,
    LABEL_RUN_ROOT,
    LABEL_RUNNER_BOOT,
    LABEL_RUNNER_PID,
    LABEL_RUNNER_START,
    LABEL_RUNNER_TICKS,
)
from sandbox.contracts.record import RunnerInfo
from sandbox.contracts.recording import REPLAY_DIR, ReplaySettings
from sandbox.contracts.spec import ContainerSpec, Mount
from sandbox.launch import firewall, runtime
from sandbox.launch.mounts import step_mounts, workflow_mounts
from sandbox.prepare.plan import RunPlan as RunPlan
from sandbox.prepare.plan import stdio_servers as stdio_servers
from sandbox.prepare.plan import step_user as step_user
from sandbox.stepside.agentworks_exec.interface import GUARD_WAIT_ENV, LANDLOCK_ENV
from sandbox.stepside.agentworks_exec.preflight import ENV as PREFLIGHT_ENV

CA_BUNDLE_VARIABLES = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "PIP_CERT",
)


def mcp_trusts_run_ca(plan: RunPlan, server: McpServer) -> bool:
    """The server's own egress is inspected somewhere, so it must trust the run's CA."""
    return plan.egress_ca is not None and server.own_egress().needs_ca()


def labels(plan: RunPlan, role: str) -> dict[str, str]:
    """What `sandbox gc` reads to tell an orphan from a live run's container."""
    return {
        LABEL_RUN_ID: plan.layout.run_id,
        LABEL_RUN_ROOT: str(plan.layout.root),
        LABEL_ROLE: role,
        **runner_labels(plan.runner),
    }


def runner_labels(runner: RunnerInfo) -> dict[str, str]:
    """The labels that name a container's runner, for `sandbox gc` to compare."""
    labels = {
        LABEL_RUNNER_PID: str(runner.pid),
        LABEL_RUNNER_START: repr(runner.create_time),
    }
    if runner.start_ticks is not None and runner.boot_id:
        labels[LABEL_RUNNER_TICKS] = str(runner.start_ticks)
        labels[LABEL_RUNNER_BOOT] = runner.boot_id
    return labels


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
        mcp_dir=MCP_DIR,
        mcp_uids={server.name: mcp_uid(i) for i, server in stdio_servers(plan.workflow)},
        egress=plan.egress,
        egress_trust_pem=plan.trusted_ca_pem,
        egress_ca_pem=plan.egress_ca.cert_pem if plan.egress_ca else "",
        egress_ca_key_pem=plan.egress_ca.key_pem if plan.egress_ca else "",
        durability=plan.durability,
        preflight_canaries=[c for c in (plan.canary, plan.canary6) if c],
        recording=plan.recording,
        replay=(
            ReplaySettings(dir=f"{DATA_DIR}/{REPLAY_DIR}", miss=plan.replay_from.miss)
            if plan.replay_from is not None
            else None
        ),
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
    script = firewall.guard_entry_script(
        GUARD_COMMAND,
        GUARD_UID,
        install=plan.install_firewall,
        redirect_root=plan.step_runtime == "runsc",  # the sentry's sockets are root's
    )
    mcp = [Mount(source=str(layout.mcp_dir), target=MCP_DIR, read_only=False)]
    return ContainerSpec(
        name=f"sandbox-{layout.run_id}-guard",
        image=names.GUARD_IMAGE,
        entrypoint=["/bin/sh", "-c", script],
        command=[],
        user="0:0",
        cap_add=GUARD_ENTRY_CAPS,
        init=False,  # tini becomes pid 1 after the drop; docker-init would stay root
        env={CONFIG_FILE_ENV: f"{DATA_DIR}/{CONFIG_FILE_NAME}"},
        mounts=[
            Mount(source=str(layout.actions), target=ACTIONS_PATH, read_only=False),
            Mount(source=str(layout.guard_dir), target=DATA_DIR, read_only=False),
            # The sockets of the stdio MCP servers (each in its own container).
            *(mcp if stdio_servers(plan.workflow) else []),
        ],
        tmpfs={"/tmp": "rw,nosuid,nodev,noexec,size=16m"},
        labels=labels(plan, "guard"),
        # The guard's own code only: what its caps let it hold (sandbox.guard.limits).
        memory_bytes=GUARD_MEMORY_BYTES,
        pids=128,
        cpus=1.0,
        network_mode=plan.networks[0] if plan.networks else "none",
        sysctls={"net.ipv4.ping_group_range": "1 0"},
        # The step's profile fits the guard too (Python, node MCP servers): no
        # ptrace, io_uring or namespaces for the one process that may go out.
        seccomp_profile=plan.seccomp_profile,
    )


def step_env(plan: RunPlan, *, has_ca_bundle: bool) -> dict[str, str]:
    """The step's whole environment: test mode, its DB copy, and its only ways out.

    `AGENTWORKS_TEST_RUN_ID` is the test run: in a whole-workflow run every step of
    the chain gets the chain's id (one test run); `AGENTWORKS_TEST_STEP_ID` is the
    workflow step and `AGENTWORKS_TEST_STEP_RUN_ID` the step's own run (its record's
    id, the run id itself when the step runs alone)."""
    proxy = f"http://127.0.0.1:{EGRESS_PORT}"
    env = {
        "AGENTWORKS_TEST_MODE": "1",
        "AGENTWORKS_TEST_RUN_ID": plan.test_run_id or plan.layout.run_id,
        "AGENTWORKS_TEST_STEP_ID": plan.step.id,
        "AGENTWORKS_TEST_STEP_RUN_ID": plan.layout.run_id,
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
        # A second wall wherever the kernel has it; Pods require it (backends.kubernetes.pod).
        LANDLOCK_ENV: "apply",
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
        image=names.STEP_IMAGE,
        command=["python3", "-m", "agentworks_exec", "--", *plan.step.argv()],
        init=False,  # the executor is pid 1 and reaps (agentworks_exec.supervisor)
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
        labels=labels(plan, "step"),
        memory_bytes=limits.memory_mb * 1024**2,
        pids=runtime.step_pids(plan.step_runtime, limits.pids),
        cpus=limits.cpus,
        seccomp_profile=runtime.profile_for(plan.step_runtime, plan.seccomp_profile),
        network_mode=f"container:{guard_id}",
        runtime=runtime.engine_runtime(plan.step_runtime),
    )


# --------------------------------------------------------------------------- MCP servers

# What a stdio server finds on its PATH: the MCP image's servers, then the system.
MCP_SERVER_PATH = "/opt/mcp/py/bin:/opt/mcp/node/node_modules/.bin:/usr/local/bin:/usr/bin:/bin"
# The system Python: the step side is on its path (the servers' venv has its own).
MCP_RELAY = ["/usr/bin/python3", "-m", "agentworks_relay"]
MCP_HOME = "/tmp"  # its own small tmpfs
MCP_MEMORY_BYTES = 512 * 1024**2  # node or Python servers take ~70 MB
MCP_PIDS = 64
MCP_TMPFS_MB = 64
MCP_LOG_BYTES = 1024**2  # its stderr, kept by the engine, read back by the host


def mcp_server_env(plan: RunPlan, index: int, server: McpServer) -> dict[str, str]:
    """A stdio server's whole environment: a minimal PATH and HOME, its own `env`, its
    `env_from_host` values, and (with an egress allow list) its proxy, and (when that
    list is inspected) the CA bundle that trusts the run's CA. Nothing else."""
    env = {
        "PATH": MCP_SERVER_PATH,
        "HOME": MCP_HOME,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if server.egress:
        proxy = f"http://127.0.0.1:{mcp_proxy_port(index)}"
        env.update(dict.fromkeys(("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"), proxy))
    if mcp_trusts_run_ca(plan, server):
        env.update(dict.fromkeys(CA_BUNDLE_VARIABLES, C_MCP_CA_BUNDLE))
    return {**env, **server.env, **plan.mcp_host_env.get(server.name, {})}


def pod_peers(plan: RunPlan) -> firewall.PodPeers | None:
    """Who shares the guard's network namespace when the run is one Pod: the step and
    each stdio server (its uid, and its relay's port when it has an egress list).
    None without stdio servers: the firewall is then the same as on Docker."""
    servers = stdio_servers(plan.workflow)
    if not servers:
        return None
    return firewall.PodPeers(
        step_uid=step_user()[0],
        guard_ports=(BRIDGE_PORT, EGRESS_PORT),
        servers=tuple(
            (mcp_uid(i), mcp_proxy_port(i) if server.egress else None) for i, server in servers
        ),
    )


def mcp_server_spec(plan: RunPlan, index: int, server: McpServer) -> ContainerSpec:
    """One stdio MCP server in a container of its own (the ToolHive way).

    Its own uid and gid, no capability, no-new-privileges, the run's seccomp
    profile, a read-only root with a small tmpfs, memory and pids limits, a
    private PID namespace (it sees no process but its own), no network at all
    (its only way out, with an allow list, is its relay to the guard's egress
    socket), the workflow folder read-only, and its own folder of the run
    read-only: the guard's sockets for it, which it can connect to but neither
    replace nor add to; with an inspected egress list, the run's CA bundle
    (certificates only) read-only. Its stderr is the container's log: only the
    host reads it.
    """
    assert server.command is not None
    uid = mcp_uid(index)
    relay = ["--socket", f"{C_MCP_DIR}/{MCP_SOCKET}"]
    if server.egress:
        relay += [
            "--egress-socket",
            f"{C_MCP_DIR}/{MCP_EGRESS_SOCKET}",
            "--proxy-port",
            str(mcp_proxy_port(index)),
        ]
    return ContainerSpec(
        name=f"sandbox-{plan.layout.run_id}-mcp-{server.name}",
        image=names.MCP_IMAGE,
        entrypoint=MCP_RELAY,
        command=[*relay, "--", *server.command],
        user=f"{uid}:{uid}",
        workdir=MCP_HOME,
        env=mcp_server_env(plan, index, server),
        mounts=[
            *workflow_mounts(plan.layout),
            Mount(source=str(plan.layout.mcp_server_dir(server.name)), target=C_MCP_DIR),
            *(
                [Mount(source=str(plan.layout.ca_bundle), target=C_MCP_CA_BUNDLE)]
                if mcp_trusts_run_ca(plan, server)
                else []
            ),
        ],
        tmpfs={"/tmp": f"rw,nosuid,nodev,size={MCP_TMPFS_MB}m,mode=1777"},
        labels={**labels(plan, "mcp"), LABEL_MCP_SERVER: server.name},
        memory_bytes=MCP_MEMORY_BYTES,
        pids=MCP_PIDS,
        cpus=1.0,
        seccomp_profile=plan.seccomp_profile,
        network_mode="none",
        log_max_bytes=MCP_LOG_BYTES,
    )
