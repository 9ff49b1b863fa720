"""The run's record (`test_mode.json`) and the action log lines, as pydantic models.

These are the contracts Builder and Pulse read, so they change only with a new
`schema_version` and a regenerated JSON Schema (`sandbox/contracts/test_mode.schema.json`). Records
are written atomically (temp file, fsync, rename) into the test run's root,
which is never mounted writable into the step: the step cannot forge them.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import UTC, datetime
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sandbox.contracts.defaults import empty_list
from sandbox.contracts.reports import CopyReport, DbCopyReport, DbDiff
from sandbox.contracts.status import ACTIONS_FILE as ACTIONS_FILE
from sandbox.contracts.status import RECORD_FILE as RECORD_FILE
from sandbox.contracts.status import RunStatus as RunStatus

SCHEMA_VERSION: Literal[1] = 1
SCHEMA_PATH: Traversable = resources.files("sandbox") / "contracts" / "test_mode.schema.json"


def utcnow() -> datetime:
    return datetime.now(UTC)


class OutputTail(BaseModel):
    """The last part of a stream: the end of a log is where the failure is."""

    text: str = ""
    total_bytes: int = 0
    truncated: bool = False


class FileChanges(BaseModel):
    """What the step did to its group folder (paths relative to it, posix), from a
    snapshot before the step and one after it: a file made and removed again during
    the run is not listed. `truncated`: a list was cut, or the folder had more entries
    than a snapshot looks at."""

    created: list[str] = Field(default_factory=empty_list)
    changed: list[str] = Field(default_factory=empty_list)
    deleted: list[str] = Field(default_factory=empty_list)
    truncated: bool = False


class Walls(BaseModel):
    """The walls the run's containers had beyond the one kernel's (README: second walls)."""

    step_runtime: str = "runc"  # "runsc": the step ran under gVisor
    userns_remap: bool = False  # the engine ran the containers in a remapped user namespace
    host_uid_base: int | None = None  # with userns_remap: host uid of container uid 0


PeakMemorySource = Literal["container_cgroup", "host_cgroup", "engine_stats", "executor_rusage"]


class Resources(BaseModel):
    """The step container's peak memory and CPU time.

    `peak_memory_source` names where `peak_memory_bytes` came from (the largest of the
    sources the run trusts for its step runtime):
    - `container_cgroup`: the container's own memory cgroup high-water mark, which the
      executor reads inside once the step has ended (runc);
    - `host_cgroup`: the same high-water mark read on the host by the runner while the
      container ran (runsc, whose sandbox hides the cgroup from the step; the sentry's
      own memory is included);
    - `engine_stats`: the engine's sampled stats of the container;
    - `executor_rusage`: the largest resident set of the step's processes, from the
      executor's rusage (never used under runsc, where the sentry reports it)."""

    peak_memory_bytes: int | None = None
    peak_memory_source: PeakMemorySource | None = None
    cpu_seconds: float | None = None


class Phases(BaseModel):
    """Seconds spent in each phase, so a slow run says where the time went."""

    prepare_s: float = 0.0
    copy_s: float = 0.0
    db_copy_s: float = 0.0
    container_start_s: float = 0.0
    step_s: float = 0.0
    collect_s: float = 0.0


class RunnerInfo(BaseModel):
    """Who ran this record's run; lets `gc` tell an orphaned run from a live one.

    `create_time` is the runner's start in wall-clock seconds (psutil's figure), which a
    clock step moves (Linux derives the boot time from the wall clock at every read);
    `start_ticks` (clock ticks since boot) and `boot_id` name the same start in terms no
    clock moves, and are what `gc` compares when they are there (records written before
    they were added have neither)."""

    pid: int
    create_time: float
    hostname: str
    start_ticks: int | None = None
    boot_id: str | None = None


class Preflight(BaseModel):
    """What the step's namespace looked like just before the step started."""

    ok: bool
    firewall_verified: bool = False
    ms: float | None = None
    checks: list[str] = Field(default_factory=empty_list)
    open: list[str] = Field(default_factory=empty_list)


class Landlock(BaseModel):
    """The Landlock wall the executor put on itself before the step started.

    `required`: the backend runs no step without it (Pods, unless the host config's
    `[backend] run_without_landlock`); else it is a second wall where the kernel has
    it. `abi`: the kernel's Landlock ABI, None without one. `applied`: writes were
    confined to the group folder, the DB copy's folder, /tmp, /dev/shm and a few
    device nodes. `scoped`: IPC kept inside the step (`abstract_unix_socket`,
    `signal`; ABI 6 and later). `reason`: why it was not applied. All defaults: the
    executor did not report (a run that never reached it, or a record from before)."""

    required: bool = False
    abi: int | None = None
    applied: bool = False
    scoped: list[str] = Field(default_factory=empty_list)
    reason: str = ""


class StubbedAction(BaseModel):
    """One line of the result's opening summary: what would have run."""

    tool: str
    reason: str
    detail: str = ""


class ActionCounts(BaseModel):
    """How many guarded calls got each decision (from the action log).

    Each call counts once (a forwarded call's `start` line, or its one line).
    `outcome_error`: forwarded calls whose outcome was an error;
    `outcome_unknown`: forwarded calls with no outcome line (the guard stopped
    mid-call). `log_full`: the log reached its cap, and the guard stubbed every
    later call without a line; `stubbed_unlogged` says how many, when the guard
    lived to write it."""

    allow: int = 0
    stub: int = 0
    redirect: int = 0
    refuse: int = 0
    malformed: int = 0
    truncated: bool = False
    outcome_error: int = 0
    outcome_unknown: int = 0
    log_full: bool = False
    stubbed_unlogged: int | None = None

    def add(self, decision: str) -> None:
        if decision in {"allow", "stub", "redirect", "refuse"}:
            setattr(self, decision, getattr(self, decision) + 1)


class UnfinishedCall(BaseModel):
    """A call the guard forwarded (its `start` line) but never wrote an outcome for:
    started, outcome unknown."""

    call_id: str
    tool: str
    decision: str
    reason: str
    started_at: datetime
    detail: str = ""


class McpServerReport(BaseModel):
    """A stdio MCP server's container at the end of the run (it ran as `uid`).

    `stderr_file` (relative to the run root) is its stderr as the host read it
    back from the engine, capped at `stderr_bytes`."""

    uid: int
    exit_code: int | None = None  # None: it was still running when the run ended
    stderr_file: str = ""
    stderr_bytes: int = 0
    stderr_truncated: bool = False


class EgressCounts(BaseModel):
    """Egress requests of one host: passed (allowed), stubbed, refused; and how the step
    reached the guard with them: `proxy` (it used the proxy variables) or `direct` (the
    firewall redirected a connection it opened itself)."""

    passed: int = 0
    stubbed: int = 0
    refused: int = 0
    direct: int = 0
    proxy: int = 0


DNS_MAX_LISTED = 200
DNS_MAX_NAME_CHARS = 120


class DnsQuery(BaseModel):
    """One distinct (name, type) the step asked the guard's DNS, with its first answer
    and how many times it was asked. A name past `DNS_MAX_NAME_CHARS` is cut, with the
    SHA-256 of the whole name, as action-log arguments are."""

    name: str
    type: str
    answer: str = ""
    count: int = 0


class DnsQueries(BaseModel):
    """Every DNS query of the step: all answered by the guard's own DNS (none leaves the
    run). `queries` counts them, `refused` those refused; `names` lists the first
    `DNS_MAX_LISTED` distinct (name, type) pairs, `names_not_listed` how many more there were."""

    queries: int = 0
    refused: int = 0
    names: list[DnsQuery] = Field(default_factory=list)
    names_not_listed: int = 0


class ContentHash(BaseModel):
    """What defined the step in this run, hashed (`sandbox.prepare.contenthash`):
    `parts` by name (command, step entry, prompt, each `code/` file, MCP servers,
    policy table, images), `digest` over all of them. A verification counts for
    this digest only."""

    digest: str
    parts: dict[str, str] = Field(default_factory=dict)


class TestRunRecord(BaseModel):
    """`runs/test-<id>/test_mode.json`."""

    model_config = ConfigDict(title="TestRunRecord")
    __test__ = False  # a model, not a pytest test class

    schema_version: Literal[1] = SCHEMA_VERSION
    test_mode: Literal[True] = True
    id: str
    # The whole-workflow test run this step ran in (its `runs/test-<id>/`), if any.
    workflow_run_id: str | None = None
    workflow_dir: str
    workflow_name: str
    step_id: str
    group: str
    command: str
    status: RunStatus
    reason: str = ""
    started_at: datetime
    finished_at: datetime | None = None
    duration_s: float | None = None
    exit_code: int | None = None
    stdout: OutputTail = Field(default_factory=OutputTail)
    stderr: OutputTail = Field(default_factory=OutputTail)
    guard_log: OutputTail = Field(default_factory=OutputTail)
    copy_report: CopyReport | None = None
    no_earlier_run: bool = False
    db_copy: DbCopyReport | None = None
    no_db: bool = False
    db_diff: DbDiff | None = None
    files: FileChanges = Field(default_factory=FileChanges)
    resources: Resources = Field(default_factory=Resources)
    preflight: Preflight | None = None
    landlock: Landlock = Field(default_factory=Landlock)
    # The most the step's disk held (its folders and /tmp, the copies it started with
    # included), sampled while it ran and at the end.
    disk_used_bytes: int | None = None
    # The copy of the group folder and the DB copy off the step's disk into the run
    # folder: what was copied and what was left out (special files, the cap).
    export_report: CopyReport | None = None
    phases: Phases = Field(default_factory=Phases)
    stubbed: list[StubbedAction] = Field(default_factory=empty_list)
    actions: ActionCounts = Field(default_factory=ActionCounts)
    outcome_unknown: list[UnfinishedCall] = Field(default_factory=empty_list)
    mcp_servers: dict[str, McpServerReport] = Field(default_factory=dict)
    egress: dict[str, EgressCounts] = Field(default_factory=dict)
    dns: DnsQueries = Field(default_factory=DnsQueries)
    actions_log: str = ACTIONS_FILE
    runner: RunnerInfo | None = None
    images: dict[str, str] = Field(default_factory=dict)
    walls: Walls = Field(default_factory=Walls)
    content: ContentHash | None = None
    # The engine that ran the containers, and on Kubernetes the node the Pod ran on.
    backend: Literal["docker", "kubernetes"] = "docker"
    node: str | None = None

    def summary_lines(self) -> list[str]:
        """The result starts with every stubbed action, then the verdict."""
        lines = [f"test run {self.id}: step {self.step_id} {self.status.value}"]
        if self.stubbed:
            lines.append(f"{len(self.stubbed)} action(s) were stubbed (would have run):")
            lines.extend(
                f"  - {a.tool}: {a.reason}" + (f" [{a.detail}]" if a.detail else "")
                for a in self.stubbed
            )
        else:
            lines.append("no action was stubbed")
        if self.preflight is not None:
            if self.preflight.ok:
                lines.append(f"preflight: every way out closed ({self.preflight.ms} ms)")
            else:
                lines.append("preflight: OPEN: " + "; ".join(self.preflight.open))
        counts = self.actions
        if counts.allow or counts.stub or counts.redirect or counts.refuse:
            lines.append(
                f"guarded calls: {counts.allow} allowed, {counts.redirect} redirected, "
                f"{counts.stub} stubbed, {counts.refuse} refused"
            )
        if self.outcome_unknown:
            lines.append(
                f"{len(self.outcome_unknown)} call(s) started, outcome unknown "
                "(the guard stopped before it wrote their outcome):"
            )
            lines.extend(
                f"  - {c.tool}" + (f" [{c.detail}]" if c.detail else "")
                for c in self.outcome_unknown
            )
        if counts.log_full:
            unlogged = counts.stubbed_unlogged
            lines.append(
                "action log full: every later call was stubbed without a line"
                + (f" ({unlogged})" if unlogged is not None else "")
            )
        for host, n in sorted(self.egress.items()):
            lines.append(
                f"egress {host or '?'}: {n.passed} passed, {n.stubbed} stubbed, {n.refused} refused"
                f" ({n.direct} direct, {n.proxy} through the proxy)"
            )
        if self.dns.queries:
            shown = [f"{q.name} {q.type} -> {q.answer}" for q in self.dns.names[:5]]
            more = len(self.dns.names) - len(shown) + self.dns.names_not_listed
            lines.append(
                f"dns: {self.dns.queries} queries answered by the guard, {self.dns.refused} "
                "refused: " + "; ".join(shown) + (f"; {more} more name(s)" if more else "")
            )
        if self.reason:
            lines.append(f"reason: {self.reason}")
        if self.exit_code is not None:
            lines.append(f"exit code: {self.exit_code}")
        if self.no_earlier_run:
            lines.append("no earlier real run: the group folder started empty")
        if self.no_db:
            lines.append("no workflow DB: the step had no DB access")
        if self.copy_report is not None and self.copy_report.left_out:
            lines.append(f"copy cap: {len(self.copy_report.left_out)} file(s) left out")
        if self.db_diff is not None:
            lines.extend(f"db: {line}" for line in self.db_diff.summary_lines())
        changes = self.files
        if changes.created or changes.changed or changes.deleted:
            lines.append(
                f"files: {len(changes.created)} created, {len(changes.changed)} changed, "
                f"{len(changes.deleted)} deleted"
            )
        return lines


def write_json_atomic(path: Path, text: str) -> None:
    """Write-then-rename so a reader never sees half a record, even if we die."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_record(run_root: Path, record: TestRunRecord) -> Path:
    path = run_root / RECORD_FILE
    write_json_atomic(path, record.model_dump_json(indent=2) + "\n")
    return path


def read_record(run_root: Path) -> TestRunRecord:
    path = run_root / RECORD_FILE
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, encoding="utf-8") as handle:
        return TestRunRecord.model_validate_json(handle.read())


def record_json_schema() -> str:
    """The published schema text; a test pins the committed file to it."""
    return json.dumps(TestRunRecord.model_json_schema(), indent=2, sort_keys=True) + "\n"
