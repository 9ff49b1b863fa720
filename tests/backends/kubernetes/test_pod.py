"""The run's Pod and Secret as manifests, from a RunPlan (pure: no cluster)."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sandbox.backends.kubernetes import pod as manifests
from sandbox.backends.kubernetes.backend import KubernetesBackend
from sandbox.contracts import names
from sandbox.contracts.config import Workflow
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.guardconfig import CONFIG_FILE_ENV
from sandbox.contracts.hostconfig import BackendConfig, load_host_config
from sandbox.contracts.layout import GUARD_UID, RunLayout
from sandbox.contracts.record import RunnerInfo
from sandbox.launch import firewall
from sandbox.launch import specs as launch

SETTINGS = BackendConfig(kind="kubernetes", namespace="runs", seccomp_profile="step.json")


def plan(tmp_path: Path, **overrides: object) -> launch.RunPlan:
    workflow = Workflow.model_validate(
        {"name": "wf", "steps": [{"id": "s", "group": "g", "command": "true", "timeout_s": 60}]}
    )
    values: dict[str, object] = {
        "workflow_dir": tmp_path,
        "workflow": workflow,
        "step": workflow.step("s"),
        "layout": RunLayout(tmp_path, "test-20261201T120000-abcdef", "g"),
        "runner": RunnerInfo(
            pid=4242,
            create_time=1.5,
            hostname="build-1",
            start_ticks=987654,
            boot_id="0f8c2a4e-5b1d-4c3e-9a7f-2d6b8e1c4f30",
        ),
        "crew": {"sales": tmp_path / "sales"},
        "has_db": True,
        "has_prompt": True,
        "seccomp_profile": "{}",
        "upstream": "http://up:8080",
        "networks": [],
        "egress": workflow.egress,
        "trusted_ca_pem": "",
        "mcp_host_env": {},
    }
    values.update(overrides)
    return launch.RunPlan(**values)  # type: ignore[arg-type]


def build(
    p: launch.RunPlan, settings: BackendConfig = SETTINGS
) -> tuple[dict[str, Any], manifests.RunMeta]:
    """The Pod from the same specs the Docker backend gets, and its run's metadata."""
    guard = launch.guard_spec(p)
    step = launch.step_spec(p, "", has_ca_bundle=p.egress_ca is not None)
    files = frozenset({str(p.layout.prompt), str(p.layout.ca_bundle), str(p.layout.actions)})
    meta = manifests.RunMeta.of(guard, runner_host=p.runner.hostname, files=files)
    return manifests.pod_manifest(guard, step, settings, meta), meta


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = pod["spec"]
    return {c["name"]: c for c in [*spec["initContainers"], *spec["containers"]]}


def volumes(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod["spec"]["volumes"]}


def test_pod_level_isolation(tmp_path: Path) -> None:
    pod = build(plan(tmp_path), SETTINGS)[0]
    spec = pod["spec"]
    assert pod["metadata"]["name"] == "sandbox-test-20261201t120000-abcdef"
    assert pod["metadata"]["namespace"] == "runs"
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert not spec["hostNetwork"] and not spec["hostPID"] and not spec["hostIPC"]
    assert spec["shareProcessNamespace"] is False
    assert spec["securityContext"]["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": "step.json",
    }
    assert spec["activeDeadlineSeconds"] > 60
    assert list(containers(pod)) == ["firewall", "guard", "step"]
    assert [c["name"] for c in spec["initContainers"]] == ["firewall"]


def test_only_the_init_container_and_the_guard_entry_hold_a_capability(tmp_path: Path) -> None:
    pod = build(plan(tmp_path), SETTINGS)[0]
    by_name = containers(pod)
    for name, container in by_name.items():
        context = container["securityContext"]
        assert context["capabilities"]["drop"] == ["ALL"], name
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["readOnlyRootFilesystem"] is True, name
        assert context["privileged"] is False, name
    assert by_name["firewall"]["securityContext"]["capabilities"]["add"] == ["NET_ADMIN"]
    assert by_name["firewall"]["securityContext"]["runAsUser"] == 0
    # The guard starts as Docker's guard entry does (the drop is its script's job).
    guard = by_name["guard"]["securityContext"]
    assert guard["capabilities"]["add"] == launch.GUARD_ENTRY_CAPS
    assert guard["runAsUser"] == 0
    step = by_name["step"]["securityContext"]
    assert "add" not in step["capabilities"]
    assert step["runAsUser"] == launch.step_user()[0] and step["runAsNonRoot"] is True


def test_the_pod_guard_runs_the_docker_entrys_bind_and_drop(tmp_path: Path) -> None:
    """The same last line as Docker's entry: bind the log group, drop every capability
    to the guard's uid, then tini and the guard; nothing of the guard runs before it."""
    p = plan(tmp_path)
    guard = containers(build(p, SETTINGS)[0])["guard"]
    assert guard["command"] == ["/bin/sh", "-c"]
    (script,) = guard["args"]
    subprocess.run(["sh", "-n"], input=script, text=True, check=True)
    docker_entry = (launch.guard_spec(p).entrypoint or [""])[-1]
    drop = script.splitlines()[-1]
    assert drop == docker_entry.splitlines()[-1]
    assert drop.startswith(f"exec {launch.GUARD_COMMAND[0]} -m sandbox.guard.nflogbind setpriv ")
    for flag in ("--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all"):
        assert flag in drop
    assert f"--reuid={GUARD_UID}" in drop and f"--regid={GUARD_UID}" in drop
    assert drop.endswith("tini -- " + " ".join(launch.GUARD_COMMAND))


def test_a_host_may_run_pods_without_the_landlock_wall(tmp_path: Path) -> None:
    settings = SETTINGS.model_copy(update={"run_without_landlock": True})
    step = containers(build(plan(tmp_path), settings)[0])["step"]
    assert {"name": "AGENTWORKS_LANDLOCK", "value": "apply"} in step["env"]


def test_the_init_container_installs_and_checks_the_firewall(tmp_path: Path) -> None:
    init = containers(build(plan(tmp_path), SETTINGS)[0])["firewall"]
    script = init["args"][0]
    for args in firewall.rules().values():
        assert firewall.restore_input(args) in script
    assert "\n".join(firewall.expected_readback()) in script
    assert "exit 1" in script and firewall.READY_MARK in script
    # The script is valid shell, and it is the only thing the init container runs.
    subprocess.run(["sh", "-n"], input=script, text=True, check=True)
    assert init["command"] == ["/bin/sh", "-c"] and init["image"] == names.GUARD_IMAGE


def test_the_pods_firewall_redirects_the_step_to_the_guard_and_lets_no_one_else_out(
    tmp_path: Path,
) -> None:
    """Transparent egress on a Pod as on Docker: the init container installs the same
    nat rules (only the step's uid redirected when stdio MCP servers share the Pod), and
    each ACCEPT the filter holds for another uid than the guard's stays on loopback (or
    is a reply, or neighbour discovery, which no uid can send)."""
    p = plan(tmp_path)
    script = containers(build(p, SETTINGS)[0])["firewall"]["args"][0]
    assert "iptables-restore -w --noflush <<'NAT'" in script
    # Installed, then the chain read back exactly as written.
    chain = "\n".join(["-N SANDBOX-STEP-OUT", *firewall.nat_rules()])
    assert f"""[ "$(iptables -w -t nat -S SANDBOX-STEP-OUT)" = '{chain}' ]""" in script
    for rule in firewall.nat_rules():
        assert f"{rule}\n" in script.split("NAT\n")[0]
    shared = firewall.init_container_script(
        peers=firewall.PodPeers(step_uid=10001, guard_ports=(8790,), servers=((10101, 3129),))
    )
    assert "-A SANDBOX-STEP-OUT -m owner ! --uid-owner 10001 -j RETURN" in shared
    v4 = firewall.rules(
        peers=firewall.PodPeers(step_uid=10001, guard_ports=(8790,), servers=((10101, 3129),))
    )["iptables"]
    # The step's redirected connections are accepted before its per-uid REJECT.
    assert v4.index(firewall.REDIRECTED[0]) < v4.index(
        "-A OUTPUT -p tcp -m owner --uid-owner 10001 -j REJECT --reject-with tcp-reset"
    )
    served = firewall.PodPeers(step_uid=10001, guard_ports=(8790, 8792), servers=((10101, 3129),))
    for peers in (None, served):
        for args in firewall.rules(peers=peers).values():
            for rule in args:
                if not rule.endswith("-j ACCEPT") or f"--uid-owner {GUARD_UID} -j" in rule:
                    continue
                assert (
                    "-o lo " in rule
                    or "-d 127.0.0.1/32 " in rule
                    or rule == firewall.ESTABLISHED
                    or "--icmpv6-type 13" in rule
                ), rule


def test_the_step_is_the_docker_backends_step(tmp_path: Path) -> None:
    p = plan(tmp_path)
    pod = build(p, SETTINGS)[0]
    step = containers(pod)["step"]
    spec = launch.step_spec(p, "", has_ca_bundle=False)
    assert step["args"] == spec.command and step["workingDir"] == spec.workdir
    # The one difference: the Landlock wall is required on a Pod, a second wall on Docker.
    assert {e["name"]: e["value"] for e in step["env"]} == {
        **spec.env,
        "AGENTWORKS_LANDLOCK": "require",
    }
    assert spec.env["AGENTWORKS_LANDLOCK"] == "apply"
    assert step["image"] == names.STEP_IMAGE and step["imagePullPolicy"] == "IfNotPresent"
    limits = step["resources"]["limits"]
    assert limits["memory"] == str(p.workflow.limits.memory_mb * 1024**2)
    assert limits["cpu"] == f"{round(p.workflow.limits.cpus * 1000)}m"
    vols = volumes(pod)
    mounted = {
        m["mountPath"]: (vols[m["name"]]["hostPath"]["path"], m["readOnly"])
        for m in step["volumeMounts"]
    }
    assert mounted == {m.target: (m.source, m.read_only) for m in spec.mounts}
    writable = sorted(target for target, (_, ro) in mounted.items() if not ro)
    assert writable == ["/test/db", "/test/g", "/tmp"]
    assert mounted["/workflow"][1] and mounted["/crew/sales"][1]
    kinds = {
        vols[m["name"]]["hostPath"]["path"]: vols[m["name"]]["hostPath"]["type"]
        for m in step["volumeMounts"]
    }
    assert kinds[str(p.layout.prompt)] == "File"
    assert kinds[str(p.layout.disk_group)] == "Directory"
    assert "guard-config" not in {m["name"] for m in step["volumeMounts"]}


def test_the_guard_alone_mounts_its_config_secret(tmp_path: Path) -> None:
    p = plan(tmp_path)
    pod, meta = build(p, SETTINGS)
    by_name = containers(pod)
    guard = by_name["guard"]
    mounts = {m["mountPath"]: m for m in guard["volumeMounts"]}
    assert mounts[manifests.SECRET_DIR]["readOnly"] is True
    env = {e["name"]: e["value"] for e in guard["env"]}
    assert env[CONFIG_FILE_ENV] == f"{manifests.SECRET_DIR}/..data/config.json"
    secret_volume = volumes(pod)["guard-config"]["secret"]
    assert secret_volume["secretName"] == manifests.secret_name(p.layout.run_id)
    assert secret_volume["defaultMode"] == 0o400
    assert pod["spec"]["securityContext"]["fsGroup"] == GUARD_UID
    for name in ("firewall", "step"):
        assert "guard-config" not in {m["name"] for m in by_name[name].get("volumeMounts", [])}
    assert "tini -- " + " ".join(launch.GUARD_COMMAND) in guard["args"][0]

    config = launch.guard_config(p).model_dump_json().encode()
    secret = manifests.secret_manifest(meta, SETTINGS, config)
    assert secret["metadata"]["name"] == secret_volume["secretName"]
    data = secret["data"]["config.json"]
    assert json.loads(base64.b64decode(data))["exec_token"] == p.tokens.exec


def test_everything_is_labelled_for_gc(tmp_path: Path) -> None:
    p = plan(tmp_path)
    pod, meta = build(p, SETTINGS)
    secret = manifests.secret_manifest(meta, SETTINGS, b"{}")
    for obj in (pod, secret):
        labels = obj["metadata"]["labels"]
        assert labels[names.LABEL_MANAGED] == "true"
        assert labels[names.LABEL_RUN_ID] == p.layout.run_id
        assert labels[names.LABEL_RUNNER_PID] == "4242"
        assert labels[names.LABEL_RUNNER_START] == "1.5"
        assert labels[names.LABEL_RUNNER_TICKS] == "987654"
        assert labels[names.LABEL_RUNNER_BOOT] == "0f8c2a4e-5b1d-4c3e-9a7f-2d6b8e1c4f30"
        assert labels[manifests.LABEL_RUNNER_HOST] == "build-1"
        assert obj["metadata"]["annotations"][names.LABEL_RUN_ROOT] == str(p.layout.root)
        assert all(len(v) <= 63 for v in labels.values())


def test_a_host_name_no_label_can_hold_is_an_annotation_only(tmp_path: Path) -> None:
    p = plan(tmp_path, runner=RunnerInfo(pid=1, create_time=1.0, hostname="x" * 70))
    pod = build(p, SETTINGS)[0]
    assert manifests.LABEL_RUNNER_HOST not in pod["metadata"]["labels"]
    assert pod["metadata"]["annotations"][manifests.ANNOTATION_RUNNER_HOST] == "x" * 70


def test_a_claim_gives_each_folder_as_a_subpath(tmp_path: Path) -> None:
    settings = BackendConfig(
        kind="kubernetes", storage="pvc", claim="workflows", claim_root=str(tmp_path)
    )
    p = plan(tmp_path)
    pod = build(p, settings)[0]
    vols = volumes(pod)
    assert vols["storage"] == {
        "name": "storage",
        "persistentVolumeClaim": {"claimName": "workflows"},
    }
    assert not any("hostPath" in v for v in vols.values())
    step = containers(pod)["step"]
    subs = {m["mountPath"]: (m["subPath"], m["readOnly"]) for m in step["volumeMounts"]}
    root = p.layout.root.relative_to(tmp_path)
    assert subs["/workflow"] == (str(root / ".view"), True)
    assert subs["/test/g"] == (str(p.layout.disk_group.relative_to(tmp_path)), False)


def test_a_claim_is_never_re_owned_for_the_pods_group(tmp_path: Path) -> None:
    """A volume plugin that manages ownership would chown the whole claim (the real
    workflow folders on it) to an fsGroup: a Pod on a claim sets none, and its guard's
    Secret (mounted by the guard's container alone) is readable without it."""
    settings = BackendConfig(
        kind="kubernetes", storage="pvc", claim="workflows", claim_root=str(tmp_path)
    )
    pod = build(plan(tmp_path), settings)[0]
    assert "fsGroup" not in pod["spec"]["securityContext"]
    assert volumes(pod)["guard-config"]["secret"]["defaultMode"] == 0o444
    mounting = [
        c["name"]
        for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]
        if any(m["name"] == "guard-config" for m in c.get("volumeMounts", []))
    ]
    assert mounting == ["guard"]


def test_a_folder_off_the_claim_is_refused(tmp_path: Path) -> None:
    settings = BackendConfig(
        kind="kubernetes", storage="pvc", claim="w", claim_root=str(tmp_path / "elsewhere")
    )
    with pytest.raises(ConfigError, match="not on the run's storage claim"):
        build(plan(tmp_path), settings)[0]


def test_node_placement_and_registry(tmp_path: Path) -> None:
    settings = BackendConfig(
        kind="kubernetes",
        node_selector={"pool": "sandbox"},
        node_name="n1",
        image_prefix="registry.example/",
        image_pull_policy="Always",
    )
    pod = build(plan(tmp_path), settings)[0]
    assert pod["spec"]["nodeSelector"] == {"pool": "sandbox"}
    assert pod["spec"]["nodeName"] == "n1"
    for container in containers(pod).values():
        assert container["image"].startswith("registry.example/sandbox-")
        assert container["imagePullPolicy"] == "Always"


def test_images_mapped_to_a_digest_run_by_that_digest(tmp_path: Path) -> None:
    """The reference a Pod runs is the one its backend's `require_image` gives the
    record: by digest where the host maps it, else the prefixed tag."""
    step_ref = "registry.example/sandbox-step@sha256:" + "a" * 64
    guard_ref = "registry.example/sandbox-guard@sha256:" + "b" * 64
    settings = BackendConfig(
        kind="kubernetes",
        image_prefix="registry.example/",
        image_digests={names.STEP_IMAGE: step_ref, names.GUARD_IMAGE: guard_ref},
    )
    pod = build(plan(tmp_path), settings)[0]
    images = {name: c["image"] for name, c in containers(pod).items()}
    assert images == {"firewall": guard_ref, "guard": guard_ref, "step": step_ref}
    backend = KubernetesBackend(settings, api=None)
    assert backend.require_image(names.STEP_IMAGE) == step_ref
    assert backend.require_image(names.MCP_IMAGE) == "registry.example/" + names.MCP_IMAGE


def test_what_a_pod_cannot_hold_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Docker networks"):
        build(plan(tmp_path, networks=["net-a"]), SETTINGS)[0]


def test_the_deadline_follows_the_step_and_a_test_may_skip_the_firewall(tmp_path: Path) -> None:
    pod, meta = build(plan(tmp_path))
    assert pod["spec"]["activeDeadlineSeconds"] == manifests.MAX_DEADLINE_S
    assert meta.install_firewall
    patch = manifests.deadline_patch(elapsed_s=3.2, timeout_s=60)
    assert patch == {"spec": {"activeDeadlineSeconds": 63 + manifests.DEADLINE_MARGIN_S}}
    pod, meta = build(plan(tmp_path, install_firewall=False))
    assert not meta.install_firewall
    assert "iptables-restore" not in containers(pod)["firewall"]["args"][0]


def test_host_config(tmp_path: Path) -> None:
    path = tmp_path / "host.toml"
    path.write_text(
        '[backend]\nkind = "kubernetes"\nnamespace = "n"\nnode_selector = { a = "b" }\n'
    )
    config = load_host_config(path).backend
    assert (config.kind, config.namespace, config.node_selector) == ("kubernetes", "n", {"a": "b"})
    path.write_text('[backend]\nstorage = "pvc"\n')
    with pytest.raises(ConfigError, match="claim"):
        load_host_config(path)
    path.write_text('[backend]\nkind = "podman"\n')
    with pytest.raises(ConfigError, match=r"backend\.kind"):
        load_host_config(path)


def _pod_object(phase: str, **states: Any) -> Any:
    from kubernetes import client

    def status(name: str, state: Any) -> Any:
        return client.V1ContainerStatus(
            name=name, image="i", image_id="", ready=False, restart_count=0, state=state
        )

    init = states.pop("firewall", None)
    return client.V1Pod(
        spec=client.V1PodSpec(containers=[], node_name="n1"),
        status=client.V1PodStatus(
            phase=phase,
            init_container_statuses=[status("firewall", init)] if init else None,
            container_statuses=[status(name, state) for name, state in states.items()],
        ),
    )


def test_the_pod_view_reads_each_containers_state() -> None:
    from kubernetes import client

    from sandbox.backends.kubernetes.podrun import PodView

    done = client.V1ContainerState(
        terminated=client.V1ContainerStateTerminated(exit_code=0, reason="Completed")
    )
    oom = client.V1ContainerState(
        terminated=client.V1ContainerStateTerminated(exit_code=137, reason="OOMKilled")
    )
    running = client.V1ContainerState(running=client.V1ContainerStateRunning())
    missing = client.V1ContainerState(
        waiting=client.V1ContainerStateWaiting(reason="ErrImageNeverPull", message="no image")
    )
    creating = client.V1ContainerState(
        waiting=client.V1ContainerStateWaiting(reason="ContainerCreating")
    )
    view = PodView.of(_pod_object("Running", firewall=done, guard=running, step=oom))
    assert view.node_name == "n1" and not view.over and view.stuck() == ""
    assert view.firewall.exit_code == 0 and view.guard.running
    assert view.step.exit_code == 137 and view.step.reason == "OOMKilled"
    view = PodView.of(_pod_object("Pending", firewall=done, guard=missing, step=creating))
    assert view.stuck() == "guard: ErrImageNeverPull: no image"
    assert PodView.of(_pod_object("Failed", guard=running)).over
    assert PodView(gone=True).over


def test_the_guards_config_moves_off_the_host(tmp_path: Path) -> None:
    from sandbox.backends.kubernetes.backend import _take_guard_config

    p = plan(tmp_path)
    guard = launch.guard_spec(p)
    p.layout.guard_dir.mkdir(parents=True)
    (p.layout.guard_dir / "config.json").write_text('{"a": 1}')
    assert _take_guard_config(guard) == b'{"a": 1}'
    assert not (p.layout.guard_dir / "config.json").exists()
    (p.layout.guard_dir / "config.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        _take_guard_config(guard)


def test_stdio_servers_are_locked_down_containers_behind_per_uid_rules(tmp_path: Path) -> None:
    """Each stdio server is a container of the Pod with what its Docker spec says a Pod
    can hold, and the init container checks exactly the per-uid rules the runner
    expects from its plan (`launch.pod_peers`), its own relay port per server."""
    workflow = Workflow.model_validate(
        {
            "name": "wf",
            "steps": [{"id": "s", "group": "g", "command": "true", "timeout_s": 60}],
            "mcp_servers": [
                {"name": "web", "url": "http://up:8080/mcp"},
                {"name": "a_b", "command": ["srv"], "egress": [{"host": "x.test"}]},
                {"name": "c", "command": ["srv"]},
            ],
        }
    )
    p = plan(tmp_path, workflow=workflow, step=workflow.step("s"))
    guard = launch.guard_spec(p)
    step = launch.step_spec(p, "", has_ca_bundle=False)
    servers = [launch.mcp_server_spec(p, i, s) for i, s in launch.stdio_servers(workflow)]
    files = frozenset({str(p.layout.prompt), str(p.layout.actions)})
    meta = manifests.RunMeta.of(guard, runner_host="h", files=files)
    pod = manifests.pod_manifest(guard, step, SETTINGS, meta, servers)
    made = containers(pod)
    assert set(made) == {"firewall", "guard", "step", "mcp-1", "mcp-2"}
    # Beside servers the step's wall must also scope abstract sockets and signals.
    assert {"name": "AGENTWORKS_LANDLOCK", "value": "require-scoped"} in made["step"]["env"]
    for name, uid in (("mcp-1", 10101), ("mcp-2", 10102)):
        server = made[name]
        context = server["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"]) == (uid, uid)
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]
        assert server["resources"]["limits"]["memory"] == str(launch.MCP_MEMORY_BYTES)
        tmp = volumes(pod)[f"{name}-tmp"]["emptyDir"]
        assert tmp == {"medium": "Memory", "sizeLimit": f"{launch.MCP_TMPFS_MB}Mi"}
        mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
        assert all(m.get("readOnly") for path, m in mounts.items() if path != "/tmp")
    # Only its own server mounts a server's socket folder; the step mounts none.
    own = {m["name"] for m in made["mcp-1"]["volumeMounts"] if m["mountPath"] == "/run/mcp"}
    other = {m["name"] for m in made["mcp-2"]["volumeMounts"] if m["mountPath"] == "/run/mcp"}
    assert own and other and not own & other
    assert not {m["name"] for m in made["step"]["volumeMounts"]} & (own | other)
    assert (
        made["mcp-1"]["env"]
        and {"name": "HTTPS_PROXY", "value": "http://127.0.0.1:3129"} in (made["mcp-1"]["env"])
    )
    peers = launch.pod_peers(p)
    assert peers is not None and peers.servers == ((10101, 3129), (10102, None))
    assert manifests.firewall_peers(step, servers) == peers
    script = made["firewall"]["args"][0]
    assert "\n".join(firewall.expected_readback(peers)) in script
    assert "--uid-owner 10101 -m tcp --dport 3129 -j ACCEPT" in script
    assert "--uid-owner 10102 -m tcp --dport" not in script  # no egress list: no port
    # Without stdio servers the rules are Docker's, the runner expects no peers.
    assert launch.pod_peers(plan(tmp_path)) is None
