"""One test run of one step: prepare -> launch -> collect -> record.

`TestRun.execute()` is the whole product in one call. It takes the workflow's
exclusive lock, prepares `runs/test-<id>/` (copy of the newest real run's
execution tree, VACUUM INTO copy of the DB, prompt with its TEST MODE
section), runs the step in a hardened container, collects what happened, and
writes the record. A record exists from the moment the run folder does; it
says `running` until the end, and `sandbox gc` turns it into `killed` if the
runner died. Containers never outlive `execute()`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import docker.errors
import psutil
import requests
from docker import DockerClient
from docker.models.containers import Container

from sandbox import actionsummary, dbdiff, firewall
from sandbox.config import (
    Egress,
    EgressEntry,
    Step,
    Workflow,
    load_workflow,
    resolve_crew_folder,
)
from sandbox.copytree import copy_execution_tree, newest_real_run
from sandbox.dbcopy import DbCopyError, copy_db, find_workflow_db
from sandbox.engine import containers, images
from sandbox.engine.client import connect
from sandbox.errors import ConfigError, LaunchError, PrepareError, SandboxError
from sandbox.guard.config import (
    ACTIONS_PATH,
    BRIDGE_PORT,
    CONFIG_ENV,
    DATA_DIR,
    EGRESS_PORT,
    EXEC_PORT,
    MCP_PATH,
    GuardConfig,
)
from sandbox.guard.tls import CA_FILE as EGRESS_CA_FILE
from sandbox.layout import (
    C_CA_BUNDLE,
    C_DB_PATH,
    C_PROMPT,
    C_WORKFLOW,
    GUARD_UID,
    STEP_UID,
    RunLayout,
    make_private_dir,
    new_run_id,
)
from sandbox.lock import LockHeldError, workflow_run_lock
from sandbox.mounts import step_mounts
from sandbox.preflight import ENV as PREFLIGHT_ENV
from sandbox.preflight import FAILED_EXIT as PREFLIGHT_FAILED_EXIT
from sandbox.preflight import MARK_FAILED as PREFLIGHT_FAILED
from sandbox.preflight import MARK_OK as PREFLIGHT_OK
from sandbox.prompt import with_test_mode_section
from sandbox.quota import QuotaWatch
from sandbox.record import (
    Preflight,
    Resources,
    RunnerInfo,
    RunStatus,
    TestRunRecord,
    write_record,
)
from sandbox.seccomp import step_profile
from sandbox.spec import ContainerSpec, Mount
from sandbox.step_exec import USAGE_MARK
from sandbox.watch import FolderWatch

log = logging.getLogger("sandbox")


class RunInterrupted(BaseException):
    """The runner was told to stop (SIGTERM/SIGINT): the record says `killed`."""


@dataclass(frozen=True)
class RunOptions:
    timeout_s: float | None = None
    upstream_bridge: str | None = None
    upstream_networks: tuple[str, ...] = ()
    allow_hosts: tuple[str, ...] = ()  # egress allow-list additions for this run only
    # Addresses ("host:port") the preflight must find unreachable from the step.
    canary: str | None = None
    canary6: str | None = None
    # Only for tests that prove the preflight catches an open namespace.
    install_firewall: bool = True


@dataclass(frozen=True)
class Tokens:
    """Per-run secrets: the step's bridge token and the guard's executor token."""

    bridge: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    exec: str = field(default_factory=lambda: secrets.token_urlsafe(24))


def _preflight_from(stderr: str, firewall_verified: bool) -> Preflight | None:
    """The executor's preflight report: the first stderr line, before the step's own."""
    for line in stderr.splitlines()[:5]:
        marker, _, payload = line.partition(" ")
        if marker in (PREFLIGHT_OK, PREFLIGHT_FAILED):
            try:
                report = Preflight.model_validate_json(payload)
            except ValueError:
                return Preflight(ok=False, open=["unreadable preflight report"])
            # The init container read the rules back before this container existed.
            return report.model_copy(update={"firewall_verified": firewall_verified})
    return None


def _resources(usage: containers.Usage, stderr: str) -> Resources:
    """Peak memory and CPU: the executor's final rusage report, else the engine's samples."""
    peak, cpu = usage.peak_memory_bytes, usage.cpu_seconds
    for line in reversed(stderr.splitlines()[-5:]):
        marker, _, payload = line.partition(" ")
        if marker == USAGE_MARK:
            try:
                report = json.loads(payload)
                cpu = float(report["cpu_seconds"])
                peak = max(peak or 0, int(report["max_rss_bytes"])) or None
            except (ValueError, KeyError, TypeError):
                pass
            break
    return Resources(peak_memory_bytes=peak, cpu_seconds=cpu)


def _mcp_host_env(workflow: Workflow) -> dict[str, dict[str, str]]:
    """Credentials for MCP servers come from the runner's environment, by name."""
    out: dict[str, dict[str, str]] = {}
    for server in workflow.mcp_servers:
        missing = [name for name in server.env_from_host if name not in os.environ]
        if missing:
            raise ConfigError(
                f"MCP server {server.name!r} needs {', '.join(missing)} in the runner's environment"
            )
        out[server.name] = {name: os.environ[name] for name in server.env_from_host}
    return out


def _verdict(
    exit_code: int | None,
    timeout_s: float,
    guard_running: bool,
    guard_exit: int | None,
    actions: actionsummary.ActionSummary,
    *,
    preflight: Preflight | None,
    quota_mb: int | None,
) -> tuple[RunStatus, str]:
    """The run's status, most telling cause first: a step that never started, a fence it
    hit, a dead guard, a refused Crew call, and only then its own exit code."""
    if preflight is not None and not preflight.ok:
        opened = "; ".join(preflight.open)
        return (
            RunStatus.ERROR,
            f"preflight found a way out open, so the step never started: {opened}",
        )
    if preflight is None and exit_code == PREFLIGHT_FAILED_EXIT:
        return RunStatus.ERROR, "the preflight failed without a report"
    if quota_mb is not None:
        return RunStatus.QUOTA, (
            f"the step's folders passed their disk quota of {quota_mb} MB; the step was stopped"
        )
    if exit_code is None:
        return RunStatus.TIMEOUT, f"step exceeded its timeout of {timeout_s:g} s"
    if not guard_running:
        return RunStatus.ERROR, (
            f"the guard stopped during the run (exit {guard_exit}); "
            "the step's calls after that failed closed"
        )
    if actions.fails_step:
        return RunStatus.FAILED, actions.fails_step
    if exit_code != 0:
        return RunStatus.FAILED, f"step exited with code {exit_code}"
    return RunStatus.PASSED, ""


def _runner_info() -> RunnerInfo:
    me = psutil.Process()
    return RunnerInfo(pid=me.pid, create_time=me.create_time(), hostname=socket.gethostname())


def _step_user() -> tuple[int, int]:
    """A root runner hands the step a fixed unprivileged uid; others run it as themselves."""
    if os.geteuid() == 0:
        return STEP_UID, STEP_UID
    return os.getuid(), os.getgid()


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give the step its folder without following any link inside it."""
    if os.geteuid() != 0:
        return
    os.chown(root, uid, gid, follow_symlinks=False)
    for dirpath, dirnames, filenames, dirfd in os.fwalk(root, follow_symlinks=False):
        del dirpath
        for name in [*dirnames, *filenames]:
            os.chown(name, uid, gid, dir_fd=dirfd, follow_symlinks=False)


class TestRun:
    """One step, once, in test mode."""

    __test__ = False  # not a pytest test class

    def __init__(self, workflow_dir: Path, step_id: str, options: RunOptions | None = None):
        self.workflow_dir = Path(workflow_dir).absolute()
        self.step_id = step_id
        self.options = options or RunOptions()

    # -- the whole flow ------------------------------------------------------

    def execute(self) -> TestRunRecord:
        """Run it. Raises SandboxError only before a run folder exists."""
        workflow = load_workflow(self.workflow_dir)
        step = workflow.step(self.step_id)
        crew = {c.name: resolve_crew_folder(self.workflow_dir, c) for c in workflow.crew_folders}
        prompt = self._read_prompt(step)
        _mcp_host_env(workflow)  # a missing credential fails before any folder exists
        seccomp_text = step_profile()
        client = connect()
        step_image = images.require(client, images.STEP_IMAGE)

        layout = RunLayout(self.workflow_dir, new_run_id(), step.group)
        started = datetime.now(UTC)
        record = TestRunRecord(
            id=layout.run_id,
            workflow_dir=str(self.workflow_dir),
            workflow_name=workflow.name,
            step_id=step.id,
            group=step.group,
            command=step.display_command(),
            status=RunStatus.RUNNING,
            started_at=started,
            runner=_runner_info(),
            images={"step": step_image},
        )
        try:
            lock = workflow_run_lock(
                self.workflow_dir, exclusive=True, owner=f"sandbox test run {layout.run_id}"
            )
        except LockHeldError as exc:
            self._make_run_root(layout)
            return self._finish(layout, record, RunStatus.REFUSED, str(exc))

        with lock:
            self._make_run_root(layout)
            write_record(layout.root, record)
            return self._run_locked(
                client, workflow, step, crew, prompt, seccomp_text, layout, record
            )

    def _run_locked(
        self,
        client: DockerClient,
        workflow: Workflow,
        step: Step,
        crew: dict[str, Path],
        prompt: str | None,
        seccomp_text: str,
        layout: RunLayout,
        record: TestRunRecord,
    ) -> TestRunRecord:
        launched: list[Container] = []
        step_started = False
        watch: FolderWatch | None = None
        quota: QuotaWatch | None = None
        usage: containers.Usage | None = None
        try:
            t0 = time.monotonic()
            self._prepare(workflow, layout, record, prompt)
            record.phases.prepare_s = time.monotonic() - t0

            t0 = time.monotonic()
            tokens = Tokens()
            guard = containers.create(
                client, self._guard_spec(workflow, step, layout, record, tokens)
            )
            launched.append(guard)
            containers.connect_networks(client, guard, self._upstream_networks(workflow)[1:])
            guard.start()
            self._install_firewall(client, guard, layout, record)
            has_ca_bundle = self._trust_egress_ca(workflow, layout)
            step_container = containers.create(
                client,
                self._step_spec(
                    workflow,
                    step,
                    crew,
                    prompt,
                    seccomp_text,
                    layout,
                    record,
                    guard,
                    tokens,
                    has_ca_bundle,
                ),
            )
            launched.append(step_container)
            watch = FolderWatch(layout.group_dir)
            watch.start()
            quota = QuotaWatch(
                [layout.group_dir, layout.db_dir],
                workflow.limits.disk_quota_mb * 1024**2,
                on_exceeded=lambda _used: containers.kill(step_container),
            )
            step_container.start()
            step_started = True
            quota.start()
            usage = containers.watch_usage(step_container)
            record.phases.container_start_s = time.monotonic() - t0

            t0 = time.monotonic()
            timeout_s = self.options.timeout_s or step.timeout_s
            exit_code = containers.wait(step_container, timeout_s)
            if exit_code is None:
                containers.kill(step_container)
            record.disk_used_bytes = quota.stop()
            record.exit_code = exit_code
            record.phases.step_s = time.monotonic() - t0

            t0 = time.monotonic()
            guard_running, guard_exit = containers.is_running(guard)
            containers.stop(guard)
            record.guard_log = containers.output_tails(guard)[1]
            record.stdout, record.stderr = containers.output_tails(step_container)
            record.preflight = _preflight_from(record.stderr.text, self.options.install_firewall)
            containers.finish_usage(usage)
            record.resources = _resources(usage, record.stderr.text)
            record.files = watch.changes()
            record.db_diff = self._db_diff(layout, record)
            actions = actionsummary.read(layout.actions)
            record.stubbed = actions.stubbed
            record.actions = actions.counts
            record.egress = actions.egress
            record.phases.collect_s = time.monotonic() - t0
            status, reason = _verdict(
                exit_code,
                timeout_s,
                guard_running,
                guard_exit,
                actions,
                preflight=record.preflight,
                quota_mb=workflow.limits.disk_quota_mb if quota.exceeded else None,
            )
            return self._finish(layout, record, status, reason)
        except SandboxError as exc:
            if not step_started:
                self._discard_partial(layout)
            return self._finish(layout, record, RunStatus.ERROR, str(exc))
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            # The engine went away (stopped, restarted) mid-run: a record, never a traceback.
            detail = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            reason = f"the Docker engine failed during the run: {detail}"
            return self._finish(layout, record, RunStatus.ERROR, reason)
        except (RunInterrupted, KeyboardInterrupt):
            return self._finish(layout, record, RunStatus.KILLED, "the runner was stopped")
        finally:
            # On every way out, the watchers stop too (in-process callers would keep their
            # threads and inotify descriptors otherwise).
            if usage is not None:
                containers.finish_usage(usage)
            if quota is not None:
                quota.cancel()
            if watch is not None:
                watch.stop()
            for container in reversed(launched):
                containers.remove(container)

    # -- launch ----------------------------------------------------------------

    def _upstream(self, workflow: Workflow) -> str | None:
        return self.options.upstream_bridge or workflow.bridge.upstream

    def _egress(self, workflow: Workflow) -> Egress:
        """The workflow's allow list plus the hosts added for this run only."""
        extra = [EgressEntry(host=h) for h in self.options.allow_hosts]
        return workflow.egress.model_copy(update={"allow": [*workflow.egress.allow, *extra]})

    def _trusted_cas(self, workflow: Workflow) -> str:
        texts = []
        for name in workflow.egress.trust_ca_files:
            path = self.workflow_dir / name
            try:
                texts.append(path.read_text(encoding="ascii"))
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"egress.trust_ca_files: {path} unreadable: {exc}") from None
        return "\n".join(texts)

    def _upstream_networks(self, workflow: Workflow) -> list[str]:
        return [*workflow.bridge.networks, *self.options.upstream_networks]

    def _guard_spec(
        self,
        workflow: Workflow,
        step: Step,
        layout: RunLayout,
        record: TestRunRecord,
        tokens: Tokens,
    ) -> ContainerSpec:
        config = GuardConfig(
            run_id=layout.run_id,
            workflow=workflow.name,
            step=step.id,
            bridge_token=tokens.bridge,
            exec_token=tokens.exec,
            has_db=not record.no_db,
            upstream=self._upstream(workflow),
            default_budget_s=workflow.bridge.default_budget_s,
            grace_s=workflow.bridge.grace_s,
            budgets=workflow.bridge.budgets,
            mcp_servers=workflow.mcp_servers,
            mcp_host_env=_mcp_host_env(workflow),
            egress=self._egress(workflow),
            egress_trust_pem=self._trusted_cas(workflow),
        )
        networks = self._upstream_networks(workflow)
        stdio_servers = sum(1 for server in workflow.mcp_servers if server.command is not None)
        return ContainerSpec(
            name=f"sandbox-{layout.run_id}-guard",
            image=images.GUARD_IMAGE,
            command=[],
            user=f"{GUARD_UID}:{GUARD_UID}",
            env={CONFIG_ENV: config.model_dump_json()},
            mounts=[
                Mount(source=str(layout.actions), target=ACTIONS_PATH, read_only=False),
                Mount(source=str(layout.guard_dir), target=DATA_DIR, read_only=False),
                # Stdio MCP servers run in the guard; their data is the workflow's, read-only.
                Mount(source=str(self.workflow_dir), target=C_WORKFLOW, read_only=True),
            ],
            tmpfs={"/tmp": "rw,nosuid,nodev,noexec,size=16m"},
            labels=self._labels(layout, "guard", record),
            # Each stdio MCP server (node or Python, ~70 MB, ~12 threads) runs in here too.
            memory_bytes=(256 + 128 * stdio_servers) * 1024**2,
            pids=128 + 32 * stdio_servers,
            cpus=1.0,
            network_mode=networks[0] if networks else "none",
            sysctls={"net.ipv4.ping_group_range": "1 0"},
            # The step's profile fits the guard too (Python, node MCP servers): no
            # ptrace, io_uring or namespaces for the one process that may go out.
            seccomp_profile=step_profile(),
        )

    def _trust_egress_ca(self, workflow: Workflow, layout: RunLayout) -> bool:
        """With TLS inspection, the step trusts this run's CA (its certificate only)."""
        if not workflow.egress.inspect_tls:
            return False
        try:
            fd = os.open(layout.guard_dir / EGRESS_CA_FILE, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as handle:
                ca_pem = handle.read(64 * 1024)
        except OSError as exc:
            raise LaunchError(f"the guard made no egress CA: {exc}") from None
        if b"PRIVATE KEY" in ca_pem or b"BEGIN CERTIFICATE" not in ca_pem:
            raise LaunchError("the guard's egress CA file is not a certificate")
        system = Path("/etc/ssl/certs/ca-certificates.crt")
        bundle = (system.read_bytes() if system.is_file() else b"") + b"\n" + ca_pem
        layout.ca_bundle.write_bytes(bundle)
        layout.ca_bundle.chmod(0o644)
        return True

    def _install_firewall(
        self, client: DockerClient, guard: Container, layout: RunLayout, record: TestRunRecord
    ) -> None:
        """A short-lived init container holds NET_ADMIN just long enough to install the rules."""
        spec = ContainerSpec(
            name=f"sandbox-{layout.run_id}-init",
            image=images.STEP_IMAGE,
            command=[
                "/bin/sh",
                "-c",
                firewall.install_script(
                    f"http://127.0.0.1:{BRIDGE_PORT}/v1/health",
                    install=self.options.install_firewall,
                ),
            ],
            user="0:0",
            cap_add=["NET_ADMIN"],
            labels=self._labels(layout, "init", record),
            memory_bytes=64 * 1024**2,
            pids=32,
            network_mode=f"container:{guard.id}",
        )
        code, output = containers.run_once(client, spec, timeout_s=60)
        installed = [ln for ln in output.splitlines() if ln.startswith(("-P", "-A"))]
        rules_ok = installed == firewall.expected_readback() or not self.options.install_firewall
        if code != 0 or not rules_ok or "READY" not in output:
            tail = " | ".join(output.strip().splitlines()[-3:])
            raise LaunchError(f"the run's firewall or guard did not come up (exit {code}): {tail}")

    def _step_spec(
        self,
        workflow: Workflow,
        step: Step,
        crew: dict[str, Path],
        prompt: str | None,
        seccomp_text: str,
        layout: RunLayout,
        record: TestRunRecord,
        guard: Container,
        tokens: Tokens,
        has_ca_bundle: bool,
    ) -> ContainerSpec:
        uid, gid = _step_user()
        env = self._step_env(layout, record, prompt is not None)
        proxy = f"http://127.0.0.1:{EGRESS_PORT}"
        if has_ca_bundle:
            for name in (
                "SSL_CERT_FILE",
                "REQUESTS_CA_BUNDLE",
                "CURL_CA_BUNDLE",
                "NODE_EXTRA_CA_CERTS",
                "GIT_SSL_CAINFO",
                "PIP_CERT",
            ):
                env[name] = C_CA_BUNDLE
        env.update(
            {
                "AGENTWORKS_BRIDGE_URL": f"http://127.0.0.1:{BRIDGE_PORT}",
                "AGENTWORKS_BRIDGE_TOKEN": tokens.bridge,
                "AGENTWORKS_MCP_URL": f"http://127.0.0.1:{BRIDGE_PORT}{MCP_PATH}",
                PREFLIGHT_ENV: json.dumps(
                    {"canary": self.options.canary, "canary6": self.options.canary6}
                ),
                "AGENTWORKS_EXEC_PORT": str(EXEC_PORT),
                "AGENTWORKS_EXEC_TOKEN": tokens.exec,
                "HTTP_PROXY": proxy,
                "HTTPS_PROXY": proxy,
                "http_proxy": proxy,
                "https_proxy": proxy,
                "NO_PROXY": "127.0.0.1,localhost",
                "no_proxy": "127.0.0.1,localhost",
            }
        )
        return ContainerSpec(
            name=f"sandbox-{layout.run_id}-step",
            image=images.STEP_IMAGE,
            command=["python3", "-m", "agentworks_exec", "--", *step.argv()],
            init=False,  # the executor is pid 1 and reaps; see step_exec._reap_until_exit
            user=f"{uid}:{gid}",
            workdir=layout.container_workdir,
            env=env,
            mounts=step_mounts(
                layout,
                crew,
                has_db=not record.no_db,
                has_prompt=prompt is not None,
                has_ca_bundle=has_ca_bundle,
            ),
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={workflow.limits.tmpfs_mb}m,mode=1777"},
            labels=self._labels(layout, "step", record),
            memory_bytes=workflow.limits.memory_mb * 1024**2,
            pids=workflow.limits.pids,
            cpus=workflow.limits.cpus,
            seccomp_profile=seccomp_text,
            network_mode=f"container:{guard.id}",
        )

    # -- prepare ---------------------------------------------------------------

    def _read_prompt(self, step: Step) -> str | None:
        if step.prompt_file is None:
            return None
        path = self.workflow_dir / step.prompt_file
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, encoding="utf-8") as handle:
                return handle.read()
        except OSError as exc:
            raise ConfigError(f"step {step.id}: prompt_file {path} unreadable: {exc}") from None

    def _make_run_root(self, layout: RunLayout) -> None:
        runs = layout.runs_dir
        if runs.is_symlink():
            raise PrepareError(f"{runs} is a symlink; refusing to create a test run through it")
        runs.mkdir(exist_ok=True)
        try:
            make_private_dir(layout.root)
        except OSError as exc:
            raise PrepareError(f"cannot create {layout.root}: {exc}") from None

    def _prepare(
        self, workflow: Workflow, layout: RunLayout, record: TestRunRecord, prompt: str | None
    ) -> None:
        uid, gid = _step_user()
        make_private_dir(layout.group_dir)
        layout.actions.touch(mode=0o644)
        make_private_dir(layout.guard_dir, 0o700)
        if os.geteuid() == 0:
            os.chown(layout.actions, GUARD_UID, GUARD_UID, follow_symlinks=False)
            os.chown(layout.guard_dir, GUARD_UID, GUARD_UID, follow_symlinks=False)
        t0 = time.monotonic()
        source = newest_real_run(self.workflow_dir, layout.group)
        if source is None:
            record.no_earlier_run = True
        else:
            record.copy_report = copy_execution_tree(
                source, layout.group_dir, cap_bytes=workflow.limits.copy_cap_mb * 1024**2
            )
        _chown_tree(layout.group_dir, uid, gid)
        record.phases.copy_s = time.monotonic() - t0

        t0 = time.monotonic()
        real_db = find_workflow_db(self.workflow_dir)
        if real_db is None:
            record.no_db = True
        else:
            make_private_dir(layout.db_dir)
            try:
                record.db_copy = copy_db(real_db, layout.db_path)
            except DbCopyError as exc:
                raise PrepareError(f"workflow DB cannot be copied: {exc}") from None
            make_private_dir(layout.baseline_db.parent, 0o700)
            shutil.copy2(layout.db_path, layout.baseline_db)
            _chown_tree(layout.db_dir, uid, gid)
        record.phases.db_copy_s = time.monotonic() - t0

        if prompt is not None:
            layout.prompt.write_text(with_test_mode_section(prompt), encoding="utf-8")
            layout.prompt.chmod(0o644)

    def _step_env(
        self, layout: RunLayout, record: TestRunRecord, has_prompt: bool
    ) -> dict[str, str]:
        env = {
            "AGENTWORKS_TEST_MODE": "1",
            "AGENTWORKS_TEST_RUN_ID": layout.run_id,
            "HOME": "/tmp",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        if not record.no_db:
            env["DB_PATH"] = C_DB_PATH
        if has_prompt:
            env["AGENTWORKS_PROMPT_FILE"] = C_PROMPT
        return env

    def _labels(self, layout: RunLayout, role: str, record: TestRunRecord) -> dict[str, str]:
        assert record.runner is not None
        return {
            containers.LABEL_RUN_ID: layout.run_id,
            containers.LABEL_RUN_ROOT: str(layout.root),
            containers.LABEL_ROLE: role,
            containers.LABEL_RUNNER_PID: str(record.runner.pid),
            containers.LABEL_RUNNER_START: repr(record.runner.create_time),
        }

    # -- collect / record --------------------------------------------------------

    def _db_diff(self, layout: RunLayout, record: TestRunRecord) -> dbdiff.DbDiff | None:
        """dbdiff reads both files into private copies without following links."""
        if record.no_db:
            return None
        return dbdiff.diff_databases(layout.baseline_db, layout.db_path)

    def _discard_partial(self, layout: RunLayout) -> None:
        """Leave only the record: nothing half-made survives a failed prepare."""
        for path in (
            layout.group_dir,
            layout.db_dir,
            layout.baseline_db.parent,
            layout.prompt,
            layout.guard_dir,
        ):
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path, ignore_errors=True)

    def _finish(
        self, layout: RunLayout, record: TestRunRecord, status: RunStatus, reason: str
    ) -> TestRunRecord:
        record.status = status
        record.reason = reason
        record.finished_at = datetime.now(UTC)
        record.duration_s = (record.finished_at - record.started_at).total_seconds()
        write_record(layout.root, record)
        return record


def execute_step(workflow_dir: Path | str, step_id: str, test_mode: bool = True) -> TestRunRecord:
    """The public entry point the Builder and Pulse call."""
    if not test_mode:
        raise ConfigError("sandbox only runs steps in test mode (test_mode=True)")
    return TestRun(Path(workflow_dir), step_id).execute()
