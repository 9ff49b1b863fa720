"""What the run's containers are (pure): who sees what, who may go out."""

from __future__ import annotations

from pathlib import Path

from sandbox.contracts import names
from sandbox.contracts.config import Workflow
from sandbox.contracts.guardconfig import CONFIG_FILE_ENV, DATA_DIR
from sandbox.contracts.layout import C_DB_PATH, GUARD_UID, MCP_UID_BASE
from sandbox.guard import limits
from sandbox.launch import specs as launch
from sandbox.prepare import plan as plan_module
from tests.launch.specparts import plan


def test_only_the_group_folder_db_copy_and_tmp_are_writable(tmp_path: Path) -> None:
    p = plan(tmp_path)
    spec = launch.step_spec(p, "guard-id", has_ca_bundle=False)
    writable = sorted((m.target, m.source) for m in spec.mounts if not m.read_only)
    # All three are folders of the run's own disk (its size is the quota).
    disk = p.layout.disk_mount
    assert writable == [
        ("/test/db", str(disk / "db")),
        ("/test/g", str(disk / "group")),
        ("/tmp", str(disk / "tmp")),
    ]
    assert spec.tmpfs == {}
    assert {m.target for m in spec.mounts if m.read_only} == {"/workflow", "/crew/sales"}
    assert spec.network_mode == "container:guard-id"
    assert spec.cap_add == [] and spec.read_only_rootfs and spec.seccomp_profile == "{}"
    assert spec.user == f"{launch.step_user()[0]}:{launch.step_user()[1]}"


def test_step_env_has_test_mode_and_no_guard_secrets(tmp_path: Path) -> None:
    p = plan(tmp_path)
    env = launch.step_env(p, has_ca_bundle=False)
    assert env["AGENTWORKS_TEST_MODE"] == "1" and env["DB_PATH"] == C_DB_PATH
    assert env["HTTP_PROXY"] == env["https_proxy"] == "http://127.0.0.1:8792"
    assert CONFIG_FILE_ENV not in env and "SSL_CERT_FILE" not in env
    no_db = launch.step_env(plan(tmp_path, has_db=False), has_ca_bundle=True)
    assert "DB_PATH" not in no_db and no_db["SSL_CERT_FILE"] == "/test/ca-bundle.pem"


def test_guard_owns_the_namespace_and_reads_its_config_from_its_folder(tmp_path: Path) -> None:
    p = plan(tmp_path)
    spec = launch.guard_spec(p)
    assert spec.network_mode == "net-a"  # the others are connected after creation
    assert spec.sysctls == {"net.ipv4.ping_group_range": "1 0"}
    # Tokens and credentials never travel in the environment (tini, pid 1, would keep it).
    assert spec.env == {CONFIG_FILE_ENV: f"{DATA_DIR}/config.json"}
    assert p.tokens.bridge not in repr(spec) and p.tokens.exec not in repr(spec)
    config = launch.guard_config(p)
    assert (config.run_id, config.upstream, config.bridge_token) == (
        "test-1",
        "http://up:8080",
        p.tokens.bridge,
    )
    assert launch.guard_spec(plan(tmp_path, networks=[])).network_mode == "none"


def test_the_guard_holds_net_admin_only_in_its_entry_script(tmp_path: Path) -> None:
    """Root with NET_ADMIN (and what setpriv needs) for the rules; then the guard uid
    with every capability set empty, execing tini and the guard."""
    p = plan(tmp_path)
    spec = launch.guard_spec(p)
    assert spec.user == "0:0" and spec.init is False
    assert sorted(spec.cap_add) == ["NET_ADMIN", "SETGID", "SETPCAP", "SETUID"]
    assert spec.entrypoint is not None and spec.entrypoint[:2] == ["/bin/sh", "-c"]
    script = spec.entrypoint[2]
    drop = script.strip().splitlines()[-1]
    # Still root: bind the refused packets' log group (sandbox.guard.nflogbind), then the drop.
    bind = f"exec {launch.GUARD_COMMAND[0]} -m sandbox.guard.nflogbind "
    assert drop.startswith(bind + "setpriv ")
    for flag in (f"--reuid={GUARD_UID}", f"--regid={GUARD_UID}", "--clear-groups"):
        assert flag in drop
    for flag in ("--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all"):
        assert flag in drop
    assert drop.endswith("-- tini -- " + " ".join(launch.GUARD_COMMAND))
    assert launch.step_spec(p, "g", has_ca_bundle=False).cap_add == []


def _with_servers(tmp_path: Path, servers: list[dict[str, object]]) -> launch.RunPlan:
    workflow = Workflow.model_validate(
        {
            "name": "wf",
            "steps": [{"id": "s", "group": "g", "command": "true"}],
            "mcp_servers": servers,
            "egress": {"allow": ["step-only.example.org"]},
        }
    )
    return plan(
        tmp_path,
        workflow=workflow,
        step=workflow.step("s"),
        egress=workflow.egress,
        mcp_host_env={"files": {"FILES_KEY": "k-secret"}},
    )


def test_each_stdio_mcp_server_is_a_container_of_its_own(tmp_path: Path) -> None:
    """Its own uid, nothing of the guard's or the step's, no network, read-only views."""
    p = _with_servers(
        tmp_path,
        [
            {
                "name": "files",
                "command": ["srv", "a"],
                "env": {"A": "1"},
                "env_from_host": ["FILES_KEY"],
            },
            {"name": "web", "url": "http://web:1/mcp"},
            {"name": "api", "command": ["api-srv"], "egress": ["api.example.org"]},
        ],
    )
    servers = launch.stdio_servers(p.workflow)
    assert [(i, s.name) for i, s in servers] == [(0, "files"), (2, "api")]
    files = launch.mcp_server_spec(p, *servers[0])
    api = launch.mcp_server_spec(p, *servers[1])
    assert (
        files.user == f"{MCP_UID_BASE}:{MCP_UID_BASE}"
        and api.user == f"{MCP_UID_BASE + 2}:{MCP_UID_BASE + 2}"
    )
    for spec in (files, api):
        assert spec.image == names.MCP_IMAGE and spec.cap_add == []
        assert spec.network_mode == "none" and spec.read_only_rootfs
        assert spec.seccomp_profile == "{}" and spec.init  # docker-init reaps, a private PID ns
        assert all(m.read_only for m in spec.mounts)
        assert {m.target for m in spec.mounts} == {"/workflow", "/run/mcp"}
        assert spec.labels["sandbox.role"] == "mcp"
        assert p.tokens.bridge not in repr(spec) and p.tokens.exec not in repr(spec)
    (own,) = [m for m in files.mounts if m.target == "/run/mcp"]
    assert own.source == str(p.layout.mcp_server_dir("files"))
    for spec in (files, api):
        # The run's view of the workflow folder (no db/, no runs/test-*), the step's own
        # one; nothing of the step's disk, and its own small /tmp.
        (workflow,) = [m for m in spec.mounts if m.target == "/workflow"]
        assert workflow.source == str(p.layout.workflow_view)
        assert not [m for m in spec.mounts if m.source.startswith(str(p.layout.disk_mount))]
        assert set(spec.tmpfs) == {"/tmp"}
    assert files.command[-3:] == ["--", "srv", "a"]
    assert files.env == {
        "PATH": launch.MCP_SERVER_PATH,
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "A": "1",
        "FILES_KEY": "k-secret",
    }
    # With an allow list: its proxy is its relay, on its own loopback; never the step's.
    # (Each server's relay has a port of its own, base + index: a Pod shares loopback.)
    assert api.env["HTTPS_PROXY"] == "http://127.0.0.1:3130" and "FILES_KEY" not in api.env
    assert "--egress-socket" in api.command and "--egress-socket" not in files.command
    # The guard: no server credential, the servers' uids, their sockets' folder.
    guard = launch.guard_spec(p)
    config = launch.guard_config(p)
    assert "k-secret" not in config.model_dump_json() + repr(guard)
    assert config.mcp_uids == {"files": MCP_UID_BASE, "api": MCP_UID_BASE + 2}
    assert {m.target for m in guard.mounts} == {"/guard/actions.jsonl", "/guard/data", "/guard/mcp"}
    assert "/workflow" not in {m.target for m in guard.mounts}


def test_a_server_whose_egress_is_inspected_trusts_the_run_ca(tmp_path: Path) -> None:
    """The run's CA (certificate only) in the server's trust when its own list is
    inspected; never for a server without a list or one that opted out."""
    servers: list[dict[str, object]] = [
        {"name": "files", "command": ["srv"]},
        {"name": "api", "command": ["api-srv"], "egress": ["api.example.org"]},
        {"name": "pinned", "command": ["p"], "egress": [{"host": "p.org", "inspect": False}]},
    ]
    p = _with_servers(tmp_path, servers)
    step_only = Workflow.model_validate(
        {"name": "wf", "steps": [{"id": "s", "group": "g", "command": "true"}]}
    )
    assert not plan_module.needs_egress_ca(step_only, step_only.egress)
    # A server's own inspected list needs the run's CA even when the step's list is empty.
    assert plan_module.needs_egress_ca(p.workflow, step_only.egress)
    p = plan(
        tmp_path,
        workflow=p.workflow,
        step=p.step,
        egress=p.egress,
        egress_ca=plan_module.EgressCA(cert_pem="CERT", key_pem="KEY-secret"),
    )
    files, api, pinned = (
        launch.mcp_server_spec(p, i, s) for i, s in launch.stdio_servers(p.workflow)
    )
    (bundle,) = [m for m in api.mounts if m.target == "/run/ca-bundle.pem"]
    assert bundle.source == str(p.layout.ca_bundle) and bundle.read_only
    assert all(api.env[name] == "/run/ca-bundle.pem" for name in launch.CA_BUNDLE_VARIABLES)
    for spec in (files, pinned):
        assert "/run/ca-bundle.pem" not in {m.target for m in spec.mounts}
        assert "SSL_CERT_FILE" not in spec.env
    for spec in (files, api, pinned):
        assert "KEY-secret" not in repr(spec)
    assert launch.guard_config(p).egress_ca_key_pem == "KEY-secret"


def test_the_guard_memory_limit_follows_the_caps_not_the_servers(tmp_path: Path) -> None:
    one = launch.guard_spec(_with_servers(tmp_path, [{"name": "a", "command": ["x"]}]))
    many = launch.guard_spec(
        _with_servers(tmp_path, [{"name": f"s{n}", "command": ["x"]} for n in range(8)])
    )
    none = launch.guard_spec(plan(tmp_path))
    assert one.memory_bytes == many.memory_bytes == none.memory_bytes == limits.GUARD_MEMORY_BYTES
    assert one.pids == many.pids == none.pids
    assert "/guard/mcp" not in {m.target for m in none.mounts}
