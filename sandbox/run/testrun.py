"""One test run of one step: prepare -> launch -> guard -> collect -> record.

`TestRun.execute()` is the whole product in one call. It takes the workflow's
exclusive lock and runs the five phases, each a method with a typed result:

- prepare: `runs/test-<id>/` made (copy of the newest real run's execution tree,
  VACUUM INTO copy of the DB, prompt with its TEST MODE section) -> `Prepared`;
- launch: the guard up with its firewall in, the step and MCP servers' containers
  started -> `Launched`;
- guard: the step runs under the guard, watched for a dead guard, a full disk and
  its timeout -> `Guarded`;
- collect: outputs, usage, file changes, DB diff and action summary read, every
  container gone -> `Collected`;
- record: the verdict written into the record.

Containers are driven only through a `sandbox.backends.Backend` (Docker by
default). A record exists from the moment the run folder does; it says `running`
until the end, and `sandbox gc` turns it into `killed` if the runner died.
Containers, the watchers, the step's disk and its view of the workflow folder
(`sandbox.stepfs.lifecycle`) never outlive `execute()`: one `ExitStack` holds their
clean-up, and any error on the way still ends the record with a final status and
a reason naming the phase.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandbox.backends import Backend, BackendFactory, ExitWatcher, RunContainer, UsageWatcher
from sandbox.collect import actionsummary, logseal
from sandbox.collect.follow import ActionFollower
from sandbox.contracts import names
from sandbox.contracts.config import (
    McpServer,
    Step,
    StepRuntime,
    Workflow,
    load_workflow,
    resolve_crew_folder,
)
from sandbox.contracts.errors import ConfigError, LaunchError, PrepareError, SandboxError
from sandbox.contracts.events import REASON_CHARS, EventCallback, EventKind, RunEvent
from sandbox.contracts.guardconfig import CONFIG_FILE_NAME, GuardConfig
from sandbox.contracts.hostconfig import Durability, load_host_config
from sandbox.contracts.ids import NO_REMAP, IdMap
from sandbox.contracts.layout import (
    GUARD_UID,
    RunLayout,
    make_private_dir,
    mcp_uid,
    new_run_id,
)
from sandbox.contracts.record import (
    McpServerReport,
    RunnerInfo,
    RunStatus,
    TestRunRecord,
    Walls,
    write_record,
)
from sandbox.contracts.reports import DbDiff
from sandbox.contracts.version import runner_version
from sandbox.contracts.wire import ActionLine
from sandbox.hostfs import fdtree
from sandbox.hostfs.fdcopy import copy_fd
from sandbox.hostfs.procstart import process_start, start_identity
from sandbox.launch import firewall
from sandbox.launch import specs as launch
from sandbox.launch.seccomp import step_profile
from sandbox.launch.specs import EgressCA, RunPlan, egress_for_run
from sandbox.prepare.contenthash import content_hash
from sandbox.prepare.copytree import copy_execution_tree, newest_real_run
from sandbox.prepare.dbcopy import DbCopyError, copy_db, find_workflow_db
from sandbox.prepare.lock import LockHeldError, workflow_run_lock
from sandbox.prepare.prompt import with_test_mode_section
from sandbox.run import verdict
from sandbox.stepfs import lifecycle as stepfs
from sandbox.stopsignals import HeldPool


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
    # How the guard syncs the action log: "group" (group commit, the runner syncs at
    # the seal) or "per-call" (each line synced before its call goes on). None: what
    # the host's config says (`durability` in host.toml; "group" without one).
    durability: Durability | None = None
    # Live progress (`--follow`): the step's start and end, and each guarded call as
    # the guard logs it. Called on the runner's threads; what it raises is ignored.
    on_event: EventCallback | None = None
    # "runsc": the step under gVisor (`--step-runtime`); see `step_runtime_for`.
    step_runtime: StepRuntime | None = None


STEP_RUNTIME_ENV = "SANDBOX_STEP_RUNTIME"


def step_runtime_for(workflow: Workflow, asked: StepRuntime | None) -> StepRuntime:
    """runsc when the workflow (`[isolation] step_runtime`), the run's options or
    `SANDBOX_STEP_RUNTIME` asks for it: any of them can add the wall, none can take
    away one the workflow asked for. An unknown value in the environment is an error."""
    env = os.environ.get(STEP_RUNTIME_ENV, "").strip()
    if env not in ("", "runc", "runsc"):
        raise ConfigError(f"{STEP_RUNTIME_ENV}={env!r}: expected runc or runsc")
    wanted = {workflow.isolation.step_runtime, asked, env}
    return "runsc" if "runsc" in wanted else "runc"


# -- the phases' results --------------------------------------------------------


@dataclass(frozen=True)
class StepInputs:
    """What the run reads from the workflow folder before any run folder exists."""

    workflow: Workflow
    step: Step
    crew: dict[str, Path]
    prompt: str | None
    mcp_host_env: dict[str, dict[str, str]]
    trusted_ca_pem: str
    seccomp_text: str


@dataclass(frozen=True)
class Seed:
    """What the step's disk starts with: the tree its group folder is a copy of (None:
    it starts empty) and the SQLite DB its DB copy is made from (None: no DB access).

    A single run seeds from the newest real run and the workflow DB; a chain step
    from what the chain's earlier steps left (see `sandbox.run.workflowrun`)."""

    group: Path | None
    db: Path | None

    @classmethod
    def from_workflow(cls, workflow_dir: Path, group: str) -> Seed:
        """The newest real run's execution tree and the real DB (look up under the lock)."""
        return cls(group=newest_real_run(workflow_dir, group), db=find_workflow_db(workflow_dir))


@dataclass(frozen=True)
class Prepared:
    """The run folder ready for containers: the step's disk mounted and filled."""

    plan: RunPlan
    files: stepfs.StepFs


@dataclass(frozen=True)
class Launched:
    """The run's containers, all started: the guard's firewall is in."""

    guard: RunContainer
    step: RunContainer
    mcp: dict[str, RunContainer]


@dataclass(frozen=True)
class Guarded:
    """The step's end under the guard: its exit code, None when its timeout hit."""

    exit_code: int | None
    timeout_s: float
    exit_watch: ExitWatcher  # the guard's: cancelled before the runner stops the guard
    usage: UsageWatcher  # the step's: finished once the step is dead
    follower: ActionFollower | None  # the action log's, with `on_event`: drained at collect


@dataclass(frozen=True)
class Collected:
    """What the record's verdict is drawn from, every container gone."""

    guard_running: bool
    guard_exit: int | None
    oom_killed: bool
    disk_full: bool
    actions: actionsummary.ActionSummary


@dataclass
class _Progress:
    """How far a run got, for its clean-up and for the reason of an unplanned error."""

    phase: str = "prepare"
    step_started: bool = False
    discard: bool = False  # a run that failed before its step started leaves only its record
    mcp_jobs: dict[str, concurrent.futures.Future[RunContainer]] = field(default_factory=dict)


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
    """This run's TLS-inspection CA (about a millisecond; see sandbox.guard.tls). Its
    module, and the X.509 library under it, load only for a run that inspects TLS."""
    from sandbox.guard.tls import RunCA

    ca = RunCA.new(run_id)
    return EgressCA(cert_pem=ca.cert_pem().decode("ascii"), key_pem=ca.key_pem().decode("ascii"))


def runner_info() -> RunnerInfo:
    """This process as a run's runner. Without its tick count or boot id (a /proc that
    hides them) it is named by its wall-clock start alone, as before they were kept."""
    pid = os.getpid()
    ticks, boot = start_identity(pid) or (None, None)
    return RunnerInfo(
        pid=pid,
        create_time=process_start(pid),
        hostname=socket.gethostname(),
        start_ticks=ticks,
        boot_id=boot,
    )


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give the step its folder without following any link inside it (fd-based, any depth)."""
    if os.geteuid() != 0:
        return
    fdtree.chown_tree(root, uid, gid)


def internal_reason(phase: str, exc: BaseException) -> str:
    """One line for a record whose run ended on an error nobody planned for."""
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"internal error during {phase}: {type(exc).__name__}" + (f": {text}" if text else "")


def host_backend() -> Backend:
    """The default backend: the one the host's config names (Docker without one)."""
    from sandbox.backends.choose import connect_backend

    return connect_backend(load_host_config().backend)


GUARD_START_DEADLINE_S = 60.0
MCP_STDERR_CAP_BYTES = 2 * launch.MCP_LOG_BYTES  # the engine keeps about MCP_LOG_BYTES


def write_guard_config(layout: RunLayout, config: GuardConfig, ids: IdMap = NO_REMAP) -> None:
    """The guard's config, in its own folder (never its environment; see contracts.guardconfig),
    readable by the guard's uid only (the host uid it has under the engine's `ids`)."""
    path = layout.guard_dir / CONFIG_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(config.model_dump_json())
    if os.geteuid() == 0:
        os.chown(path, ids.host_uid(GUARD_UID), ids.host_gid(GUARD_UID), follow_symlinks=False)


class TestRun:
    """One step, once, in test mode."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        workflow_dir: Path,
        step_id: str,
        options: RunOptions | None = None,
        backend: BackendFactory | None = None,
    ):
        self.workflow_dir = Path(workflow_dir).absolute()
        self.step_id = step_id
        self.options = options or RunOptions()
        self._connect: BackendFactory = backend or host_backend

    # -- the whole flow ------------------------------------------------------

    def execute(self) -> TestRunRecord:
        """Run it. Raises SandboxError only before a run folder exists."""
        inputs = self.read_inputs()
        # One backend per run, closed with it: its connections and threads must not
        # outlive the run (a caller running many runs in one process would pile them up).
        with contextlib.closing(self._connect()) as backend:
            return self._execute(backend, inputs)

    def read_inputs(self) -> StepInputs:
        """Everything read from the workflow folder; a missing credential fails here,
        before any folder exists."""
        workflow = load_workflow(self.workflow_dir)
        step = workflow.step(self.step_id)
        return StepInputs(
            workflow=workflow,
            step=step,
            crew={c.name: resolve_crew_folder(self.workflow_dir, c) for c in workflow.crew_folders},
            prompt=self._read_prompt(step),
            mcp_host_env=_mcp_host_env(workflow),
            trusted_ca_pem=self._trusted_cas(workflow),
            seccomp_text=step_profile(),
        )

    def _execute(self, backend: Backend, inputs: StepInputs) -> TestRunRecord:
        layout = RunLayout(self.workflow_dir, new_run_id(), inputs.step.group)
        record = self.new_record(backend, inputs, layout)
        try:
            lock = workflow_run_lock(
                self.workflow_dir, exclusive=True, owner=f"sandbox test run {layout.run_id}"
            )
        except LockHeldError as exc:
            self._make_run_root(layout)
            self._emit("step_start", record)
            return self._finish(layout, record, RunStatus.REFUSED, str(exc))

        with lock:
            # Looked up once, under the lock: the plan (DB_PATH, mounts) and the copy agree.
            seed = Seed.from_workflow(self.workflow_dir, inputs.step.group)
            self._make_run_root(layout)
            return self.run_held(backend, inputs, layout, record, seed)

    def new_record(
        self,
        backend: Backend,
        inputs: StepInputs,
        layout: RunLayout,
        *,
        workflow_run_id: str | None = None,
    ) -> TestRunRecord:
        """The run's first record (`running`); the images it needs must exist."""
        workflow, step = inputs.workflow, inputs.step
        step_runtime = step_runtime_for(workflow, self.options.step_runtime)
        backend.require_step_runtime(step_runtime)
        used_images = {"step": backend.require_image(names.STEP_IMAGE)}
        if launch.stdio_servers(workflow):
            used_images["mcp"] = backend.require_image(names.MCP_IMAGE)
        return TestRunRecord(
            runner_version=runner_version(),
            id=layout.run_id,
            workflow_run_id=workflow_run_id,
            workflow_dir=str(self.workflow_dir),
            workflow_name=workflow.name,
            step_id=step.id,
            group=step.group,
            command=step.display_command(),
            status=RunStatus.RUNNING,
            started_at=datetime.now(UTC),
            runner=runner_info(),
            images=used_images,
            content=content_hash(self.workflow_dir, workflow, step, used_images),
            backend=backend.kind,
        )

    def run_held(
        self,
        backend: Backend,
        inputs: StepInputs,
        layout: RunLayout,
        record: TestRunRecord,
        seed: Seed,
    ) -> TestRunRecord:
        """The five phases, in a run root that exists, under the workflow's exclusive
        lock that the caller holds (a single run, or a whole-workflow run for each of
        its steps). A Crew step is refused here: it never runs in test mode."""
        write_record(layout.root, record)
        self._emit("step_start", record)
        if inputs.step.kind == "crew":
            return self._finish(layout, record, RunStatus.REFUSED, _crew_reason(inputs.step))
        assert record.runner is not None
        step_runtime = step_runtime_for(inputs.workflow, self.options.step_runtime)
        ids = backend.id_map()
        options = self.options
        record.walls = Walls(
            step_runtime=step_runtime,
            userns_remap=ids.remapped,
            host_uid_base=ids.uid_base if ids.remapped else None,
            firewall=options.install_firewall,  # else the launch fails on its readback
            seccomp=bool(inputs.seccomp_text),
            egress_additions=list(options.allow_hosts),
            upstream_overrides=[
                *(
                    [f"bridge upstream {options.upstream_bridge}"]
                    if options.upstream_bridge
                    else []
                ),
                *(f"network {n}" for n in options.upstream_networks),
            ],
        )
        plan = self._plan(
            inputs,
            layout,
            record.runner,
            has_db=seed.db is not None,
            ids=ids,
            step_runtime=step_runtime,
            test_run_id=record.workflow_run_id or layout.run_id,
        )
        return self._run_phases(backend, plan, seed, inputs.prompt, record)

    def _plan(
        self,
        inputs: StepInputs,
        layout: RunLayout,
        runner: RunnerInfo,
        *,
        has_db: bool,
        ids: IdMap = NO_REMAP,
        step_runtime: StepRuntime = "runc",
        test_run_id: str = "",
    ) -> RunPlan:
        workflow = inputs.workflow
        egress = egress_for_run(workflow, self.options.allow_hosts)
        return RunPlan(
            workflow_dir=self.workflow_dir,
            workflow=workflow,
            step=inputs.step,
            layout=layout,
            runner=runner,
            crew=inputs.crew,
            has_db=has_db,
            has_prompt=inputs.prompt is not None,
            seccomp_profile=inputs.seccomp_text,
            upstream=self.options.upstream_bridge or workflow.bridge.upstream,
            networks=[*workflow.bridge.networks, *self.options.upstream_networks],
            egress=egress,
            egress_ca=(
                _egress_ca(layout.run_id) if launch.needs_egress_ca(workflow, egress) else None
            ),
            trusted_ca_pem=inputs.trusted_ca_pem,
            mcp_host_env=inputs.mcp_host_env,
            canary=self.options.canary,
            canary6=self.options.canary6,
            install_firewall=self.options.install_firewall,
            durability=self.options.durability or load_host_config().durability,
            ids=ids,
            step_runtime=step_runtime,
            test_run_id=test_run_id,
        )

    def _run_phases(
        self,
        backend: Backend,
        plan: RunPlan,
        seed: Seed,
        prompt: str | None,
        record: TestRunRecord,
    ) -> TestRunRecord:
        layout, workflow = plan.layout, plan.workflow
        files = stepfs.StepFs(layout, workflow.limits.disk_quota_mb * 1024**2)
        progress = _Progress()
        servers = launch.stdio_servers(workflow)
        with contextlib.ExitStack() as cleanup:
            # Unwound last to first, on every way out: the watchers stop, every container
            # creation returns, the containers go, then the mounts, then what a run that
            # failed before its step started left.
            cleanup.callback(self._discard_unstarted, layout, record, progress)
            cleanup.callback(self._close_files, layout, record, files, progress)
            cleanup.callback(_quietly, backend.remove_all)
            cleanup.callback(self._collect_mcp_early, layout, record, progress)
            # The MCP servers' containers are created and started in these threads, beside
            # the guard's and the step's start; the run waits for them only once the step runs.
            mcp_pool = cleanup.enter_context(HeldPool(max_workers=max(1, len(servers))))
            try:
                with _phase(progress, record, "prepare", "prepare_s"):
                    prepared = self._prepare(plan, files, seed, prompt, record)
                with _phase(progress, record, "launch", "container_start_s"):
                    launched = self._launch(backend, prepared, mcp_pool, progress)
                with _phase(progress, record, "the step", "step_s"):
                    guarded = self._guard(prepared, launched, cleanup, record)
                with _phase(progress, record, "collect", "collect_s"):
                    collected = self._collect(backend, prepared, launched, guarded, record)
                return self._record(layout, record, plan, guarded, collected)
            except SandboxError as exc:
                progress.discard = not progress.step_started
                return self._finish(layout, record, RunStatus.ERROR, str(exc))
            except backend.engine_errors as exc:
                # The engine went away (stopped, restarted) mid-run: a record, never a traceback.
                detail = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                reason = f"the {backend.engine_label} failed during the run: {detail}"
                return self._finish(layout, record, RunStatus.ERROR, reason)
            except (RunInterrupted, KeyboardInterrupt):
                return self._finish(layout, record, RunStatus.KILLED, "the runner was stopped")
            except Exception as exc:
                # Whatever went wrong, the record ends with the phase and the error.
                progress.discard = not progress.step_started
                return self._finish(
                    layout, record, RunStatus.ERROR, internal_reason(progress.phase, exc)
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

    def _trusted_cas(self, workflow: Workflow) -> str:
        texts = []
        for name in workflow.egress.trust_ca_files:
            path = self.workflow_dir / name
            try:
                texts.append(path.read_text(encoding="ascii"))
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"egress.trust_ca_files: {path} unreadable: {exc}") from None
        return "\n".join(texts)

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
        plan: RunPlan,
        files: stepfs.StepFs,
        seed: Seed,
        prompt: str | None,
        record: TestRunRecord,
    ) -> Prepared:
        """The guard's folders, the step's disk with the copies on it, the prompt; the
        copy and DB-copy reports go into the record."""
        workflow, layout, ids = plan.workflow, plan.layout, plan.ids
        step_uid, step_gid = launch.step_user()
        # Host ids: what the engine's user namespace shows the step and guard as theirs.
        uid, gid = ids.host_uid(step_uid), ids.host_gid(step_gid)
        guard_uid, guard_gid = ids.host_uid(GUARD_UID), ids.host_gid(GUARD_UID)
        # The guard's alone: no other uid of the run may write (or read) it.
        layout.actions.touch(mode=0o600)
        make_private_dir(layout.guard_dir, 0o700)
        if os.geteuid() == 0:
            os.chown(layout.actions, guard_uid, guard_gid, follow_symlinks=False)
            os.chown(layout.guard_dir, guard_uid, guard_gid, follow_symlinks=False)
        self._prepare_mcp(workflow, layout, ids)
        disk = files.open()
        t0 = time.monotonic()
        source = seed.group
        if source is None:
            record.no_earlier_run = True
        else:
            record.copy_report = copy_execution_tree(
                source, disk.group_dir, cap_bytes=workflow.limits.copy_cap_mb * 1024**2
            )
        _chown_tree(disk.group_dir, uid, gid)
        record.phases.copy_s = time.monotonic() - t0

        t0 = time.monotonic()
        if seed.db is None:
            record.no_db = True
        else:
            # The pristine copy (for the diff) is made first, off the step's disk; the
            # step's copy is a copy of it, on the disk.
            make_private_dir(layout.baseline_db.parent, 0o700)
            try:
                record.db_copy = copy_db(seed.db, layout.baseline_db)
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
        if plan.egress_ca is not None:  # before any container that trusts it exists
            self._trust_egress_ca(layout, plan.egress_ca)
        return Prepared(plan=plan, files=files)

    def _prepare_mcp(self, workflow: Workflow, layout: RunLayout, ids: IdMap) -> None:
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
            os.chown(
                layout.mcp_dir,
                ids.host_uid(GUARD_UID),
                ids.host_gid(GUARD_UID),
                follow_symlinks=False,
            )
        for index, server in servers:
            folder = layout.mcp_server_dir(server.name)
            make_private_dir(folder, 0o700)
            if root:
                os.chown(
                    folder,
                    ids.host_uid(GUARD_UID),
                    ids.host_gid(mcp_uid(index)),
                    follow_symlinks=False,
                )
                os.chmod(folder, 0o2710, follow_symlinks=False)

    def _trust_egress_ca(self, layout: RunLayout, ca: EgressCA) -> None:
        """The step (and any MCP server whose egress is inspected) trusts this run's CA
        (its certificate only) beside the system's."""
        system = Path("/etc/ssl/certs/ca-certificates.crt")
        bundle = (system.read_bytes() if system.is_file() else b"") + b"\n" + ca.cert_pem.encode()
        fd = os.open(layout.ca_bundle, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(bundle)

    # -- launch ----------------------------------------------------------------

    def _launch(
        self,
        backend: Backend,
        prepared: Prepared,
        mcp_pool: concurrent.futures.ThreadPoolExecutor,
        progress: _Progress,
    ) -> Launched:
        """Every container of the run started: the MCP servers' in `mcp_pool`, the guard
        with its firewall in, then the step."""
        plan = prepared.plan
        for index, server in launch.stdio_servers(plan.workflow):
            progress.mcp_jobs[server.name] = mcp_pool.submit(
                self._start_mcp, backend, plan, index, server
            )
        guard, step = self._start_guard(backend, plan)
        progress.step_started = True
        mcp = {name: job.result() for name, job in progress.mcp_jobs.items()}
        return Launched(guard=guard, step=step, mcp=mcp)

    def _start_guard(self, backend: Backend, plan: RunPlan) -> tuple[RunContainer, RunContainer]:
        """The guard up with its firewall in and read back right, and the step's
        container started.

        The step is created beside the guard's start and started as soon as the guard's
        container runs (it joins its network namespace), so the firewall's install, the
        guard's start-up and the step container's start overlap. The step command itself
        waits: the executor starts it only once the guard listens, and the guard's entry
        script starts the guard only after the rules are in and read back exactly as
        expected (`firewall.guard_entry_script`); the runner checks the same readback
        here too, and a run whose firewall failed never gets past this phase. The step's
        CA bundle (with TLS inspection) holds the CA the runner made, so nothing waits
        for the guard. (The MCP servers' containers start beside all of it; each relay
        waits for its socket.)"""
        write_guard_config(plan.layout, launch.guard_config(plan), plan.ids)
        guard = backend.create(launch.guard_spec(plan))
        backend.connect_networks(guard, plan.networks[1:])
        spec = launch.step_spec(plan, guard.id, has_ca_bundle=plan.egress_ca is not None)
        # Leaving the pool waits for the creation on every way out, so an interrupted
        # launch never leaves a container that the backend does not hold (HeldPool: a
        # stop cannot land between the pool starting its thread and counting it).
        with HeldPool(max_workers=1) as pool:
            early_step = pool.submit(backend.create, spec)
            with guard.follow_output(deadline_s=GUARD_START_DEADLINE_S) as output:
                guard.start()
                step = early_step.result()
                try:
                    step.start()
                except Exception:
                    # A guard whose firewall failed is gone: the step cannot join it.
                    if not output.wait_for_line(firewall.READY_MARK):
                        raise LaunchError(
                            f"the run's firewall did not come up: {output.tail()}"
                        ) from None
                    raise
                if not output.wait_for_line(firewall.READY_MARK):
                    raise LaunchError(f"the run's firewall did not come up: {output.tail()}")
                # The guard's entry script printed the rules back; they must be exactly ours.
                installed = firewall.installed_rules(output.lines())
                # One Pod shares its namespace: the per-uid rules of its peers too.
                peers = launch.pod_peers(plan) if backend.kind == "kubernetes" else None
                if plan.install_firewall and installed != firewall.expected_readback(peers):
                    raise LaunchError(
                        f"the run's firewall reads back wrong: {' | '.join(installed)}"
                    )
        return guard, step

    def _start_mcp(
        self, backend: Backend, plan: RunPlan, index: int, server: McpServer
    ) -> RunContainer:
        container = backend.create(launch.mcp_server_spec(plan, index, server), independent=True)
        container.start()
        return container

    # -- guard -----------------------------------------------------------------

    def _guard(
        self,
        prepared: Prepared,
        launched: Launched,
        cleanup: contextlib.ExitStack,
        record: TestRunRecord,
    ) -> Guarded:
        """The step runs under its guard until it exits or its timeout hits; a dead
        guard or a full disk kills it at once. The watchers' stops are held by `cleanup`."""
        step = launched.step
        # Started after the step, so a guard already dead kills a step that runs.
        exit_watch = launched.guard.watch_exit(on_exit=step.kill)
        cleanup.callback(exit_watch.cancel)
        prepared.files.watch(on_full=lambda _usage: step.kill())
        usage = step.watch_usage()
        cleanup.callback(usage.finish)
        follower = None
        if self.options.on_event is not None:
            follower = ActionFollower(prepared.plan.layout.actions, self._on_action(record))
            cleanup.callback(follower.start().stop)
        timeout_s = self.options.timeout_s or prepared.plan.step.timeout_s
        exit_code = step.wait(timeout_s)
        if exit_code is None:
            step.kill()
        record.exit_code = exit_code
        return Guarded(
            exit_code=exit_code,
            timeout_s=timeout_s,
            exit_watch=exit_watch,
            usage=usage,
            follower=follower,
        )

    # -- collect ---------------------------------------------------------------

    def _collect(
        self,
        backend: Backend,
        prepared: Prepared,
        launched: Launched,
        guarded: Guarded,
        record: TestRunRecord,
    ) -> Collected:
        """Read everything the run left, in the order that keeps it true: the engine's
        view of the containers before they go, the step's disk once nothing writes it."""
        plan, files, layout = prepared.plan, prepared.files, prepared.plan.layout
        guarded.exit_watch.cancel()
        guard_state = launched.guard.state()
        step_state = launched.step.state()
        launched.guard.stop()
        if guarded.follower is not None:
            guarded.follower.stop()  # the guard is gone: every line it wrote is read
        # The seal: nothing writes the log any more; synced by the runner whatever the
        # guard did (a failure leaves the record unsealed: it then verifies nothing).
        with contextlib.suppress(OSError):
            record.log_synced_at = logseal.seal_log(layout.root, layout.actions.name)
        record.guard_log = launched.guard.output_tails()[1]
        record.stdout, record.stderr = launched.step.output_tails()
        record.preflight = verdict.preflight_from(record.stderr.text, plan.install_firewall)
        record.landlock = verdict.landlock_from(record.stderr.text)
        record.walls = verdict.judge_walls(record.walls, record.preflight, record.landlock)
        guarded.usage.finish()
        record.resources = verdict.resources(
            guarded.usage, record.stderr.text, executor_sees_memory=plan.step_runtime == "runc"
        )
        record.stderr = verdict.without_reports(record.stderr)
        # What the servers said is read from the engine before their containers go.
        record.mcp_servers = self._collect_mcp(layout, launched.mcp)
        # The step is dead: nothing writes its disk any more. Its folders move off the
        # disk into the run folder, then the disk goes.
        record.node = backend.node()
        backend.remove_all()
        collected = files.collect(has_db=not record.no_db)
        files.close()
        record.disk_used_bytes = collected.peak_bytes
        record.files = collected.files
        record.export_report = collected.export
        record.db_diff = self._db_diff(layout, record)
        actions = actionsummary.read(layout.actions)
        record.stubbed, record.stubbed_cut = actions.stubbed, actions.stubbed_cut
        record.actions = actions.counts
        record.egress = actions.egress
        record.dns = actions.dns
        record.outcome_unknown = actions.outcome_unknown
        return Collected(
            guard_running=guard_state.running,
            guard_exit=guard_state.exit_code,
            oom_killed=step_state.oom_killed,
            disk_full=collected.full,
            actions=actions,
        )

    def _collect_mcp(
        self, layout: RunLayout, mcp: dict[str, RunContainer]
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
                state = container.state()
                user = container.user.partition(":")[0]
                report = McpServerReport(
                    uid=int(user) if user.isdigit() else -1,
                    exit_code=None if state.running else state.exit_code,
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
                    size, cut = container.save_output(fd, MCP_STDERR_CAP_BYTES)
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

    def _db_diff(self, layout: RunLayout, record: TestRunRecord) -> DbDiff | None:
        """dbdiff reads both files into private copies (holes kept, size-capped) without
        following links. (Imported here: a run without a DB never loads it.)"""
        if record.no_db:
            return None
        from sandbox.collect import dbdiff

        # Its private copies live in the run root: on the workflow's disk, gone after.
        return dbdiff.diff_databases(layout.baseline_db, layout.db_path, work_dir=layout.root)

    # -- record ----------------------------------------------------------------

    def _record(
        self,
        layout: RunLayout,
        record: TestRunRecord,
        plan: RunPlan,
        guarded: Guarded,
        collected: Collected,
    ) -> TestRunRecord:
        limits = plan.workflow.limits
        status, reason = verdict.verdict(
            guarded.exit_code,
            guarded.timeout_s,
            collected.guard_running,
            collected.guard_exit,
            collected.actions,
            preflight=record.preflight,
            quota_mb=limits.disk_quota_mb if collected.disk_full else None,
            oom_mb=limits.memory_mb if collected.oom_killed else None,
            landlock=record.landlock,
        )
        return self._finish(layout, record, status, reason)

    def _finish(
        self, layout: RunLayout, record: TestRunRecord, status: RunStatus, reason: str
    ) -> TestRunRecord:
        record.status = status
        record.reason = reason
        record.finished_at = datetime.now(UTC)
        record.duration_s = (record.finished_at - record.started_at).total_seconds()
        write_record(layout.root, record)
        self._emit("step_end", record, status=status.value, duration_s=record.duration_s)
        return record

    # -- live progress -------------------------------------------------------------

    def _emit(self, kind: EventKind, record: TestRunRecord, **fields: Any) -> None:
        """One event to `on_event`, if given; whatever it raises stays out of the run."""
        callback = self.options.on_event
        if callback is None:
            return
        event = RunEvent(
            kind=kind, time=datetime.now(UTC), run_id=record.id, step_id=record.step_id, **fields
        )
        with contextlib.suppress(Exception):
            callback(event)

    def _on_action(self, record: TestRunRecord) -> Callable[[ActionLine], None]:
        def on_line(line: ActionLine) -> None:
            if line.event == "outcome":
                return  # a forwarded call counts once, at its start line
            self._emit(
                "action",
                record,
                decision=line.decision,
                tool=line.tool,
                reason=line.reason[:REASON_CHARS],
            )

        return on_line

    # -- clean-up ----------------------------------------------------------------

    def _collect_mcp_early(
        self, layout: RunLayout, record: TestRunRecord, progress: _Progress
    ) -> None:
        """A run that ended before its collect phase keeps what its servers said (best
        effort: the clean-up after it must run whatever the engine says)."""
        if record.mcp_servers:
            return
        started = {
            name: job.result()
            for name, job in progress.mcp_jobs.items()
            if job.done() and job.exception() is None
        }
        if started:
            with contextlib.suppress(Exception):
                record.mcp_servers = self._collect_mcp(layout, started)
                write_record(layout.root, record)

    def _close_files(
        self, layout: RunLayout, record: TestRunRecord, files: stepfs.StepFs, progress: _Progress
    ) -> None:
        """Unmount the run's disk and view; a failure to is said in the record.

        A run that ended early after its step started still gets what the step left
        copied into the run folder first (best effort: the copy is capped and link-safe
        whatever state the step left the disk in)."""
        try:
            if progress.step_started and files.disk is not None and not files.collected:
                with contextlib.suppress(Exception):
                    record.export_report = files.collect(has_db=not record.no_db).export
                    write_record(layout.root, record)
            files.close()
        except Exception as exc:
            record.reason += ("; " if record.reason else "") + internal_reason("clean-up", exc)
            write_record(layout.root, record)

    def _discard_unstarted(
        self, layout: RunLayout, record: TestRunRecord, progress: _Progress
    ) -> None:
        """Leave only the record: nothing half-made survives a failed prepare or launch
        (fd-based, any depth: whatever the guard left in its folders is deleted too).
        The servers' stderr files stay when the record names them. Runs after the
        containers that mounted any of it are gone."""
        if not progress.discard:
            return
        said = any(report.stderr_file for report in record.mcp_servers.values())
        with contextlib.suppress(Exception):
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


@contextlib.contextmanager
def _phase(progress: _Progress, record: TestRunRecord, name: str, timing: str) -> Iterator[None]:
    """Name the phase (for an unplanned error's reason) and time it into the record."""
    progress.phase = name
    t0 = time.monotonic()
    yield
    setattr(record.phases, timing, time.monotonic() - t0)


def _crew_reason(step: Step) -> str:
    return (
        f"step {step.id} is a Crew step (crew {step.crew or '?'}): a Crew call acts in "
        "another project, so test mode refuses it; it did not run"
    )


def _quietly(action: Callable[[], None]) -> None:
    """A clean-up step whose failure must not stop the ones after it."""
    with contextlib.suppress(Exception):
        action()


def execute_step(
    workflow_dir: Path | str,
    step_id: str,
    test_mode: bool = True,
    *,
    on_event: EventCallback | None = None,
) -> TestRunRecord:
    """The public entry point the Builder and Pulse call; `on_event` gets the step's
    start, each guarded call as the guard logs it, and its end, while it runs."""
    if not test_mode:
        raise ConfigError("sandbox only runs steps in test mode (test_mode=True)")
    return TestRun(Path(workflow_dir), step_id, RunOptions(on_event=on_event)).execute()
