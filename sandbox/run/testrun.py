"""One test run of one step: prepare -> launch -> collect -> record.

`TestRun.execute()` is the whole product in one call. It takes the workflow's
exclusive lock, prepares `runs/test-<id>/` (copy of the newest real run's
execution tree, VACUUM INTO copy of the DB, prompt with its TEST MODE
section), runs the step in a hardened container, collects what happened, and
writes the record. A record exists from the moment the run folder does; it
says `running` until the end, and `sandbox gc` turns it into `killed` if the
runner died. Containers, the step's disk and its view of the workflow folder
(`sandbox.stepfs.lifecycle`) never outlive `execute()`; any error on the way still ends the
record with a final status and a reason naming the phase.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import docker.errors
import psutil
import requests
from docker import DockerClient
from docker.models.containers import Container

from sandbox.backends.docker import containers, images
from sandbox.backends.docker.client import connect
from sandbox.collect import actionsummary, dbdiff
from sandbox.contracts import names
from sandbox.contracts.config import (
    McpServer,
    Step,
    Workflow,
    load_workflow,
    resolve_crew_folder,
)
from sandbox.contracts.errors import ConfigError, LaunchError, PrepareError, SandboxError
from sandbox.contracts.hostconfig import BackendConfig, load_host_config
from sandbox.contracts.layout import (
    GUARD_UID,
    RunLayout,
    make_private_dir,
    mcp_uid,
    new_run_id,
)
from sandbox.contracts.record import (
    McpServerReport,
    OutputTail,
    Preflight,
    Resources,
    RunnerInfo,
    RunStatus,
    TestRunRecord,
    write_record,
)
from sandbox.contracts.reports import DbDiff
from sandbox.guard.config import CONFIG_FILE_NAME, GuardConfig
from sandbox.guard.tls import RunCA
from sandbox.hostfs import fdtree
from sandbox.hostfs.fdcopy import copy_fd
from sandbox.launch import firewall
from sandbox.launch import specs as launch
from sandbox.launch.seccomp import step_profile
from sandbox.launch.specs import EgressCA, RunPlan, egress_for_run
from sandbox.prepare.copytree import copy_execution_tree, newest_real_run
from sandbox.prepare.dbcopy import DbCopyError, copy_db, find_workflow_db
from sandbox.prepare.lock import LockHeldError, workflow_run_lock
from sandbox.prepare.prompt import with_test_mode_section
from sandbox.stepfs import lifecycle as stepfs
from sandbox.stepside.agentworks_exec.preflight import FAILED_EXIT as PREFLIGHT_FAILED_EXIT
from sandbox.stepside.agentworks_exec.preflight import MARK_FAILED as PREFLIGHT_FAILED
from sandbox.stepside.agentworks_exec.preflight import MARK_OK as PREFLIGHT_OK
from sandbox.stepside.agentworks_exec.tools import USAGE_MARK

if TYPE_CHECKING:
    from sandbox.backends.kubernetes.backend import KubernetesBackend


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
    # fdatasync each action-log line before the reply (benchmarks measure the cost).
    fsync_action_log: bool = True
    # The engine and its settings; None: the host's config (`sandbox.contracts.hostconfig`).
    backend: BackendConfig | None = None


def _preflight_from(stderr: str, firewall_verified: bool) -> Preflight | None:
    """The executor's preflight report: the first stderr line, before the step's own."""
    for line in stderr.splitlines()[:5]:
        marker, _, payload = line.partition(" ")
        if marker in (PREFLIGHT_OK, PREFLIGHT_FAILED):
            try:
                report = Preflight.model_validate_json(payload)
            except ValueError:
                return Preflight(ok=False, open=["unreadable preflight report"])
            # The guard's entry script read the rules back before this container started.
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
                measured = [int(report["max_rss_bytes"]), int(report.get("cgroup_peak_bytes", 0))]
                peak = max(peak or 0, *measured) or None
            except (ValueError, KeyError, TypeError):
                pass
            break
    return Resources(peak_memory_bytes=peak, cpu_seconds=cpu)


def _without_reports(tail: OutputTail) -> OutputTail:
    """The step's own stderr: the executor's report lines live in their own fields."""
    markers = (PREFLIGHT_OK, PREFLIGHT_FAILED, USAGE_MARK)
    kept = [ln for ln in tail.text.splitlines(keepends=True) if not ln.startswith(markers)]
    return tail.model_copy(update={"text": "".join(kept)})


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
    oom_mb: int | None = None,
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
            f"the step's disk (group folder, DB copy and /tmp) reached its disk quota of "
            f"{quota_mb} MB; the step was stopped"
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
    if oom_mb is not None:
        return RunStatus.FAILED, (
            f"memory limit of {oom_mb} MB reached: the kernel killed the step "
            f"(exit code {exit_code})"
        )
    if exit_code != 0:
        return RunStatus.FAILED, f"step exited with code {exit_code}"
    return RunStatus.PASSED, ""


def _copy_file(src: Path, dst: Path) -> None:
    """A runner-made file into a new file (holes kept); neither end is followed."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    src_fd = os.open(src, os.O_RDONLY | flags)
    try:
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o644)
        try:
            copy_fd(src_fd, dst_fd)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def _egress_ca(run_id: str) -> EgressCA:
    """This run's TLS-inspection CA (about a millisecond; see sandbox.guard.tls)."""
    ca = RunCA.new(run_id)
    return EgressCA(cert_pem=ca.cert_pem().decode("ascii"), key_pem=ca.key_pem().decode("ascii"))


def _runner_info() -> RunnerInfo:
    me = psutil.Process()
    return RunnerInfo(pid=me.pid, create_time=me.create_time(), hostname=socket.gethostname())


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give the step its folder without following any link inside it (fd-based, any depth)."""
    if os.geteuid() != 0:
        return
    fdtree.chown_tree(root, uid, gid)


def _internal_reason(phase: str, exc: BaseException) -> str:
    """One line for a record whose run ended on an error nobody planned for."""
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"internal error during {phase}: {type(exc).__name__}" + (f": {text}" if text else "")


GUARD_START_DEADLINE_S = 60.0
MCP_STDERR_CAP_BYTES = 2 * launch.MCP_LOG_BYTES  # the engine keeps about MCP_LOG_BYTES


def write_guard_config(layout: RunLayout, config: GuardConfig) -> None:
    """The guard's config, in its own folder (never its environment; see guard.config)."""
    path = layout.guard_dir / CONFIG_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(config.model_dump_json())
    if os.geteuid() == 0:
        os.chown(path, GUARD_UID, GUARD_UID, follow_symlinks=False)


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
        mcp_host_env = _mcp_host_env(workflow)  # a missing credential fails before any folder
        trusted_ca_pem = self._trusted_cas(workflow)
        seccomp_text = step_profile()
        backend = self.options.backend or load_host_config().backend
        if backend.kind == "kubernetes":
            from sandbox.backends.kubernetes.backend import KubernetesBackend

            kube = KubernetesBackend(backend)
            try:
                return self._execute(
                    kube, workflow, step, crew, prompt, mcp_host_env, trusted_ca_pem, seccomp_text
                )
            finally:
                kube.close()
        # One client per run, closed with it: its pooled connections to the engine must
        # not outlive the run (a caller running many runs in one process would pile them up).
        with contextlib.closing(connect()) as client:
            return self._execute(
                client, workflow, step, crew, prompt, mcp_host_env, trusted_ca_pem, seccomp_text
            )

    def _execute(
        self,
        client: DockerClient | KubernetesBackend,
        workflow: Workflow,
        step: Step,
        crew: dict[str, Path],
        prompt: str | None,
        mcp_host_env: dict[str, dict[str, str]],
        trusted_ca_pem: str,
        seccomp_text: str,
    ) -> TestRunRecord:
        if isinstance(client, DockerClient):
            used_images = {"step": images.require(client, names.STEP_IMAGE)}
            if launch.stdio_servers(workflow):
                used_images["mcp"] = images.require(client, names.MCP_IMAGE)
        else:  # the nodes hold (or pull) the images: the record names the references
            used_images = {"step": client.image(names.STEP_IMAGE)}

        layout = RunLayout(self.workflow_dir, new_run_id(), step.group)
        runner = _runner_info()
        record = TestRunRecord(
            id=layout.run_id,
            workflow_dir=str(self.workflow_dir),
            workflow_name=workflow.name,
            step_id=step.id,
            group=step.group,
            command=step.display_command(),
            status=RunStatus.RUNNING,
            started_at=datetime.now(UTC),
            runner=runner,
            images=used_images,
            backend="docker" if isinstance(client, DockerClient) else "kubernetes",
        )
        try:
            lock = workflow_run_lock(
                self.workflow_dir, exclusive=True, owner=f"sandbox test run {layout.run_id}"
            )
        except LockHeldError as exc:
            self._make_run_root(layout)
            return self._finish(layout, record, RunStatus.REFUSED, str(exc))

        with lock:
            # Looked up once, under the lock: the plan (DB_PATH, mounts) and the copy agree.
            real_db = find_workflow_db(self.workflow_dir)
            self._make_run_root(layout)
            write_record(layout.root, record)
            egress = egress_for_run(workflow, self.options.allow_hosts)
            plan = RunPlan(
                workflow_dir=self.workflow_dir,
                workflow=workflow,
                step=step,
                layout=layout,
                runner=runner,
                crew=crew,
                has_db=real_db is not None,
                has_prompt=prompt is not None,
                seccomp_profile=seccomp_text,
                upstream=self.options.upstream_bridge or workflow.bridge.upstream,
                networks=[*workflow.bridge.networks, *self.options.upstream_networks],
                egress=egress,
                egress_ca=(
                    _egress_ca(layout.run_id) if launch.needs_egress_ca(workflow, egress) else None
                ),
                trusted_ca_pem=trusted_ca_pem,
                mcp_host_env=mcp_host_env,
                canary=self.options.canary,
                canary6=self.options.canary6,
                install_firewall=self.options.install_firewall,
                fsync_action_log=self.options.fsync_action_log,
            )
            if not isinstance(client, DockerClient):
                return self._run_locked_pod(client, plan, real_db, prompt, record)
            return self._run_locked(client, plan, real_db, prompt, record)

    def _run_locked_pod(
        self,
        kube: KubernetesBackend,
        plan: RunPlan,
        real_db: Path | None,
        prompt: str | None,
        record: TestRunRecord,
    ) -> TestRunRecord:
        """The same phases with the containers in one Pod on a cluster (see
        `sandbox.backends.kubernetes`): the host prepares and collects as on Docker."""
        from sandbox.backends.kubernetes.podrun import PodRun

        layout, workflow = plan.layout, plan.workflow
        files = stepfs.StepFs(layout, workflow.limits.disk_quota_mb * 1024**2)
        pod: PodRun | None = None
        step_started = False
        discard = False
        phase = "prepare"
        try:
            t0 = time.monotonic()
            self._prepare(workflow, layout, record, real_db, prompt, files)
            record.phases.prepare_s = time.monotonic() - t0

            phase = "launch"
            t0 = time.monotonic()
            if plan.egress_ca is not None:
                self._trust_egress_ca(layout, plan.egress_ca)
            pod = kube.start(plan)
            step_started = True
            started = pod
            files.watch(on_full=lambda _usage: started.kill())
            record.phases.container_start_s = time.monotonic() - t0

            phase = "the step"
            t0 = time.monotonic()
            timeout_s = self.options.timeout_s or plan.step.timeout_s
            exit_code = kube.wait(pod, timeout_s)
            record.exit_code = exit_code
            record.phases.step_s = time.monotonic() - t0

            phase = "collect"
            t0 = time.monotonic()
            outcome = kube.collect(pod)
            record.node = outcome.node
            record.guard_log = outcome.guard_log
            record.stdout = outcome.output
            record.preflight = _preflight_from(outcome.output.text, plan.install_firewall)
            record.resources = _resources(containers.Usage(), outcome.output.text)
            record.stdout = _without_reports(outcome.output)
            kube.remove(pod)
            collected = files.collect(has_db=not record.no_db)
            files.close()
            record.disk_used_bytes = collected.peak_bytes
            record.files = collected.files
            record.export_report = collected.export
            record.db_diff = self._db_diff(layout, record)
            actions = actionsummary.read(layout.actions)
            record.stubbed = actions.stubbed
            record.actions = actions.counts
            record.egress = actions.egress
            record.outcome_unknown = actions.outcome_unknown
            record.phases.collect_s = time.monotonic() - t0
            status, reason = _verdict(
                exit_code,
                timeout_s,
                outcome.guard_running,
                outcome.guard_exit,
                actions,
                preflight=record.preflight,
                quota_mb=workflow.limits.disk_quota_mb if collected.full else None,
                oom_mb=workflow.limits.memory_mb if outcome.oom else None,
            )
            return self._finish(layout, record, status, reason)
        except SandboxError as exc:
            discard = not step_started
            return self._finish(layout, record, RunStatus.ERROR, str(exc))
        except (RunInterrupted, KeyboardInterrupt):
            return self._finish(layout, record, RunStatus.KILLED, "the runner was stopped")
        except Exception as exc:
            discard = not step_started
            return self._finish(layout, record, RunStatus.ERROR, _internal_reason(phase, exc))
        finally:
            if pod is not None:
                try:
                    kube.remove(pod)
                except Exception as exc:
                    record.reason += ("; " if record.reason else "") + _internal_reason(
                        "clean-up", exc
                    )
                    write_record(layout.root, record)
            self._close_files(layout, record, files, export=step_started)
            if discard:
                with contextlib.suppress(Exception):
                    self._discard_partial(layout, record)

    def _run_locked(
        self,
        client: DockerClient,
        plan: RunPlan,
        real_db: Path | None,
        prompt: str | None,
        record: TestRunRecord,
    ) -> TestRunRecord:
        layout, workflow = plan.layout, plan.workflow
        owned = containers.OwnedContainers(client)
        files = stepfs.StepFs(layout, workflow.limits.disk_quota_mb * 1024**2)
        step_started = False
        discard = False  # a run that failed before its step started leaves only its record
        guard_watch: containers.ExitWatch | None = None
        usage: containers.Usage | None = None
        mcp: dict[str, Container] = {}
        servers = launch.stdio_servers(workflow)
        # The MCP servers' containers are created and started in these threads, beside
        # the guard's and the step's start; the run waits for them only once the step runs.
        mcp_pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(servers)))
        mcp_jobs: dict[str, concurrent.futures.Future[Container]] = {}
        phase = "prepare"
        try:
            t0 = time.monotonic()
            self._prepare(workflow, layout, record, real_db, prompt, files)
            record.phases.prepare_s = time.monotonic() - t0

            phase = "launch"
            t0 = time.monotonic()
            if plan.egress_ca is not None:  # before any container that trusts it exists
                self._trust_egress_ca(layout, plan.egress_ca)
            for index, server in servers:
                mcp_jobs[server.name] = mcp_pool.submit(self._start_mcp, owned, plan, index, server)
            guard, step_container = self._launch(client, plan, owned)
            step_container.start()
            step_started = True
            # Started after the step, so a guard already dead kills a step that runs.
            guard_watch = containers.ExitWatch(
                guard, on_exit=lambda: containers.kill(step_container)
            )
            files.watch(on_full=lambda _usage: containers.kill(step_container))
            usage = containers.watch_usage(step_container)
            for name, job in mcp_jobs.items():
                mcp[name] = job.result()
            record.phases.container_start_s = time.monotonic() - t0

            phase = "the step"
            t0 = time.monotonic()
            timeout_s = self.options.timeout_s or plan.step.timeout_s
            exit_code = containers.wait(step_container, timeout_s)
            if exit_code is None:
                containers.kill(step_container)
            record.exit_code = exit_code
            record.phases.step_s = time.monotonic() - t0

            phase = "collect"
            t0 = time.monotonic()
            guard_watch.cancel()
            guard_running, guard_exit = containers.is_running(guard)
            oom = containers.oom_killed(step_container)
            containers.stop(guard)
            record.guard_log = containers.output_tails(guard)[1]
            record.stdout, record.stderr = containers.output_tails(step_container)
            record.preflight = _preflight_from(record.stderr.text, plan.install_firewall)
            containers.finish_usage(usage)
            record.resources = _resources(usage, record.stderr.text)
            record.stderr = _without_reports(record.stderr)
            # What the servers said is read from the engine before their containers go.
            record.mcp_servers = self._collect_mcp(layout, mcp)
            # The step is dead: nothing writes its disk any more. Its folders move off the
            # disk into the run folder, then the disk goes.
            owned.remove_all()
            collected = files.collect(has_db=not record.no_db)
            files.close()
            record.disk_used_bytes = collected.peak_bytes
            record.files = collected.files
            record.export_report = collected.export
            record.db_diff = self._db_diff(layout, record)
            actions = actionsummary.read(layout.actions)
            record.stubbed = actions.stubbed
            record.actions = actions.counts
            record.egress = actions.egress
            record.outcome_unknown = actions.outcome_unknown
            record.phases.collect_s = time.monotonic() - t0
            status, reason = _verdict(
                exit_code,
                timeout_s,
                guard_running,
                guard_exit,
                actions,
                preflight=record.preflight,
                quota_mb=workflow.limits.disk_quota_mb if collected.full else None,
                oom_mb=workflow.limits.memory_mb if oom else None,
            )
            return self._finish(layout, record, status, reason)
        except SandboxError as exc:
            discard = not step_started
            return self._finish(layout, record, RunStatus.ERROR, str(exc))
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            # The engine went away (stopped, restarted) mid-run: a record, never a traceback.
            detail = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            reason = f"the Docker engine failed during the run: {detail}"
            return self._finish(layout, record, RunStatus.ERROR, reason)
        except (RunInterrupted, KeyboardInterrupt):
            return self._finish(layout, record, RunStatus.KILLED, "the runner was stopped")
        except Exception as exc:
            # Whatever went wrong, the record ends with the phase and the error.
            discard = not step_started
            return self._finish(layout, record, RunStatus.ERROR, _internal_reason(phase, exc))
        finally:
            # On every way out, the watchers stop and the containers go, then the mounts.
            if usage is not None:
                containers.finish_usage(usage)
            if guard_watch is not None:
                guard_watch.cancel()
            # Every creation has returned before the clean-up, so none outlives the run.
            mcp_pool.shutdown(wait=True)
            if not record.mcp_servers:  # a run that ended early keeps what its servers said
                started = {
                    name: job.result()
                    for name, job in mcp_jobs.items()
                    if job.done() and job.exception() is None
                }
                if started:
                    # Best effort: the clean-up below must run whatever the engine says.
                    with contextlib.suppress(Exception):
                        record.mcp_servers = self._collect_mcp(layout, started)
                        write_record(layout.root, record)
            with contextlib.suppress(Exception):
                owned.remove_all()
            if guard_watch is not None:
                guard_watch.join()
            self._close_files(layout, record, files, export=step_started)
            if discard:  # after the containers that mounted any of it are gone
                with contextlib.suppress(Exception):
                    self._discard_partial(layout, record)

    def _close_files(
        self, layout: RunLayout, record: TestRunRecord, files: stepfs.StepFs, *, export: bool
    ) -> None:
        """Unmount the run's disk and view; a failure to is said in the record.

        A run that ended early after its step started still gets what the step left
        copied into the run folder first (best effort: the copy is capped and link-safe
        whatever state the step left the disk in)."""
        try:
            if export and files.disk is not None and not files.collected:
                with contextlib.suppress(Exception):
                    record.export_report = files.collect(has_db=not record.no_db).export
                    write_record(layout.root, record)
            files.close()
        except Exception as exc:
            record.reason += ("; " if record.reason else "") + _internal_reason("clean-up", exc)
            write_record(layout.root, record)

    # -- launch ----------------------------------------------------------------

    def _trusted_cas(self, workflow: Workflow) -> str:
        texts = []
        for name in workflow.egress.trust_ca_files:
            path = self.workflow_dir / name
            try:
                texts.append(path.read_text(encoding="ascii"))
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"egress.trust_ca_files: {path} unreadable: {exc}") from None
        return "\n".join(texts)

    def _trust_egress_ca(self, layout: RunLayout, ca: EgressCA) -> None:
        """The step (and any MCP server whose egress is inspected) trusts this run's CA
        (its certificate only) beside the system's."""
        system = Path("/etc/ssl/certs/ca-certificates.crt")
        bundle = (system.read_bytes() if system.is_file() else b"") + b"\n" + ca.cert_pem.encode()
        fd = os.open(layout.ca_bundle, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(bundle)

    def _launch(
        self, client: DockerClient, plan: RunPlan, owned: containers.OwnedContainers
    ) -> tuple[Container, Container]:
        """The guard up with its firewall in, and the step created but not started.

        The step is created beside the guard's start and started while the guard is
        still importing (its executor waits for the guard to listen), so the guard's
        start-up and the step container's overlap; only the firewall must be in first.
        The step's CA bundle (with TLS inspection) holds the CA the runner made, so
        nothing waits for the guard. (The MCP servers' containers start beside all of
        it; each relay waits for its socket.)"""
        write_guard_config(plan.layout, launch.guard_config(plan))
        guard = owned.create(launch.guard_spec(plan))
        containers.connect_networks(client, guard, plan.networks[1:])
        spec = launch.step_spec(plan, str(guard.id), has_ca_bundle=plan.egress_ca is not None)
        # Leaving the pool waits for the creation on every way out, so an interrupted
        # launch never leaves a container that `owned` does not hold.
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            early_step = pool.submit(owned.create, spec)
            with containers.OutputFollower(guard, deadline_s=GUARD_START_DEADLINE_S) as output:
                guard.start()
                self._await_firewall(plan, output)
            step_container = early_step.result()
        return guard, step_container

    def _start_mcp(
        self, owned: containers.OwnedContainers, plan: RunPlan, index: int, server: McpServer
    ) -> Container:
        container = owned.create(launch.mcp_server_spec(plan, index, server), independent=True)
        container.start()
        return container

    def _collect_mcp(
        self, layout: RunLayout, mcp: dict[str, Container]
    ) -> dict[str, McpServerReport]:
        """Each server's exit and its output, saved by the host into mcp-stderr/ (root
        only, a folder no container sees): the folder is opened once without following a
        link, and each file is made in it with O_EXCL | O_NOFOLLOW, never through a path."""
        reports: dict[str, McpServerReport] = {}
        try:
            folder_fd: int | None = fdtree.open_root(layout.mcp_stderr_dir)
        except OSError:
            folder_fd = None
        try:
            for name, container in sorted(mcp.items()):
                running, code = containers.is_running(container)
                user = str(container.attrs.get("Config", {}).get("User", "")).partition(":")[0]
                report = McpServerReport(
                    uid=int(user) if user.isdigit() else -1,
                    exit_code=None if running else code,
                )
                reports[name] = report
                if folder_fd is None:
                    continue
                try:
                    fd = os.open(
                        f"{name}.log",
                        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o600,
                        dir_fd=folder_fd,
                    )
                except OSError:
                    continue
                try:
                    size, cut = containers.save_output(container, fd, MCP_STDERR_CAP_BYTES)
                finally:
                    os.close(fd)
                reports[name] = report.model_copy(
                    update={
                        "stderr_file": f"{layout.mcp_stderr_dir.name}/{name}.log",
                        "stderr_bytes": size,
                        "stderr_truncated": cut,
                    }
                )
        finally:
            if folder_fd is not None:
                os.close(folder_fd)
        return reports

    def _await_firewall(self, plan: RunPlan, output: containers.OutputFollower) -> None:
        """The guard's entry script printed the rules back; they must be exactly ours."""
        if not output.wait_for_line(firewall.READY_MARK):
            raise LaunchError(f"the run's firewall did not come up: {output.tail()}")
        installed = [ln for ln in output.lines() if ln.startswith(("-P", "-A"))]
        if plan.install_firewall and installed != firewall.expected_readback():
            raise LaunchError(f"the run's firewall reads back wrong: {' | '.join(installed)}")

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
        self,
        workflow: Workflow,
        layout: RunLayout,
        record: TestRunRecord,
        real_db: Path | None,
        prompt: str | None,
        files: stepfs.StepFs,
    ) -> None:
        uid, gid = launch.step_user()
        # The guard's alone: no other uid of the run may write (or read) it.
        layout.actions.touch(mode=0o600)
        make_private_dir(layout.guard_dir, 0o700)
        if os.geteuid() == 0:
            os.chown(layout.actions, GUARD_UID, GUARD_UID, follow_symlinks=False)
            os.chown(layout.guard_dir, GUARD_UID, GUARD_UID, follow_symlinks=False)
        self._prepare_mcp(workflow, layout)
        disk = files.open()
        t0 = time.monotonic()
        source = newest_real_run(self.workflow_dir, layout.group)
        if source is None:
            record.no_earlier_run = True
        else:
            record.copy_report = copy_execution_tree(
                source, disk.group_dir, cap_bytes=workflow.limits.copy_cap_mb * 1024**2
            )
        _chown_tree(disk.group_dir, uid, gid)
        record.phases.copy_s = time.monotonic() - t0

        t0 = time.monotonic()
        if real_db is None:
            record.no_db = True
        else:
            # The pristine copy (for the diff) is made first, off the step's disk; the
            # step's copy is a copy of it, on the disk.
            make_private_dir(layout.baseline_db.parent, 0o700)
            try:
                record.db_copy = copy_db(real_db, layout.baseline_db)
                _copy_file(layout.baseline_db, disk.db_dir / layout.db_path.name)
            except DbCopyError as exc:
                raise PrepareError(f"workflow DB cannot be copied: {exc}") from None
            except OSError as exc:
                raise PrepareError(
                    f"workflow DB copy does not fit the step's disk: {exc}"
                ) from None
            record.db_copy = record.db_copy.model_copy(update={"dest": str(layout.db_path)})
            _chown_tree(disk.db_dir, uid, gid)
        record.phases.db_copy_s = time.monotonic() - t0
        files.snapshot_before()

        if prompt is not None:
            layout.prompt.write_text(with_test_mode_section(prompt), encoding="utf-8")
            layout.prompt.chmod(0o644)

    def _prepare_mcp(self, workflow: Workflow, layout: RunLayout) -> None:
        """Per stdio server, a folder for the guard's sockets: the guard's, and only that
        server's group may pass (setgid, so the sockets are that group's); the step and
        the other servers cannot. Their stderr goes to a root-only folder at the end."""
        servers = launch.stdio_servers(workflow)
        if not servers:
            return
        make_private_dir(layout.mcp_dir, 0o700)
        make_private_dir(layout.mcp_stderr_dir, 0o700)
        root = os.geteuid() == 0
        if root:
            os.chown(layout.mcp_dir, GUARD_UID, GUARD_UID, follow_symlinks=False)
        for index, server in servers:
            folder = layout.mcp_server_dir(server.name)
            make_private_dir(folder, 0o700)
            if root:
                os.chown(folder, GUARD_UID, mcp_uid(index), follow_symlinks=False)
                os.chmod(folder, 0o2710, follow_symlinks=False)

    # -- collect / record --------------------------------------------------------

    def _db_diff(self, layout: RunLayout, record: TestRunRecord) -> DbDiff | None:
        """dbdiff reads both files into private copies (holes kept, size-capped) without
        following links."""
        if record.no_db:
            return None
        # Its private copies live in the run root: on the workflow's disk, gone after.
        return dbdiff.diff_databases(layout.baseline_db, layout.db_path, work_dir=layout.root)

    def _discard_partial(self, layout: RunLayout, record: TestRunRecord) -> None:
        """Leave only the record: nothing half-made survives a failed prepare or launch
        (fd-based, any depth: whatever the guard left in its folders is deleted too).
        The servers' stderr files stay when the record names them."""
        said = any(report.stderr_file for report in record.mcp_servers.values())
        stepfs.discard(
            [
                layout.group_dir,
                layout.db_dir,
                layout.baseline_db.parent,
                layout.prompt,
                layout.guard_dir,
                layout.mcp_dir,
                *([] if said else [layout.mcp_stderr_dir]),
            ]
        )

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
