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
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sandbox.contracts.defaults import empty_list
from sandbox.contracts.record_egress import DNS_MAX_LISTED as DNS_MAX_LISTED
from sandbox.contracts.record_egress import DNS_MAX_NAME_CHARS as DNS_MAX_NAME_CHARS
from sandbox.contracts.record_egress import PACKETS_MAX_LISTED as PACKETS_MAX_LISTED
from sandbox.contracts.record_egress import DnsQueries as DnsQueries
from sandbox.contracts.record_egress import DnsQuery as DnsQuery
from sandbox.contracts.record_egress import EgressCounts as EgressCounts
from sandbox.contracts.record_egress import RefusedPacket as RefusedPacket
from sandbox.contracts.record_egress import RefusedPackets as RefusedPackets
from sandbox.contracts.recording import RecordingSummary, ReplaySummary
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

    text: str = Field(default="", description="The stream's last 8,000 characters.")
    total_bytes: int = Field(
        default=0, description="Every byte the step wrote to the stream, however large."
    )
    truncated: bool = Field(default=False, description="`text` is only the end of the stream.")


class FileChanges(BaseModel):
    """What the step did to its group folder (paths relative to it, posix), from a
    snapshot before the step and one after it: a file made and removed again during
    the run is not listed. `truncated`: a list was cut, or the folder had more entries
    than a snapshot looks at."""

    created: list[str] = Field(
        default_factory=empty_list,
        description=("Files the step created in its group folder (paths relative to it)."),
    )
    changed: list[str] = Field(
        default_factory=empty_list, description="Files whose content, mode or type changed."
    )
    deleted: list[str] = Field(default_factory=empty_list, description="Files the step deleted.")
    truncated: bool = Field(
        default=False,
        description=("A list was cut, or the folder had more entries than a snapshot looks at."),
    )


class Walls(BaseModel):
    """The walls the run had, and whether they were every wall of a normal run.

    A normal run (`execute_step`, `sandbox run`) has: the firewall installed and read
    back exactly as expected (`firewall`), the step's seccomp profile (`seccomp`), a
    preflight that found every way out closed, the Landlock wall where the backend
    requires it, and the egress allow list of `workflow.toml` with nothing added for the
    run (`egress_additions`). `full` is True only when the run had all of them;
    `lacking` says what it lacked (the gate accepts no verification without `full`).
    `upstream_overrides` (another bridge upstream, more networks for the guard) are
    recorded: they change what the guard reaches, not the walls around the step.
    Beyond those, the walls beyond the one kernel's (README: second walls)."""

    step_runtime: str = Field(
        default="runc", description="`runc`, or `runsc`: the step ran under gVisor."
    )  # "runsc": the step ran under gVisor
    userns_remap: bool = Field(
        default=False, description="The engine ran the containers in a remapped user namespace."
    )  # the engine ran the containers in a remapped user namespace
    host_uid_base: int | None = Field(
        default=None, description="With `userns_remap`: the host uid of container uid 0."
    )  # with userns_remap: host uid of container uid 0
    firewall: bool = Field(
        default=False, description=("The firewall was installed and read back exactly as expected.")
    )
    seccomp: bool = Field(
        default=False, description="The step ran under the project's seccomp profile."
    )
    egress_additions: list[str] = Field(
        default_factory=empty_list,
        description=("Hosts added to the egress allow list for this run only (`--allow-host`)."),
    )
    upstream_overrides: list[str] = Field(
        default_factory=empty_list,
        description=("Another bridge upstream or more guard networks given for this run."),
    )
    full: bool = Field(
        default=False,
        description=(
            "The run had every wall of a normal run; the gate accepts no verification without it."
        ),
    )
    lacking: list[str] = Field(
        default_factory=empty_list, description="What the run lacked of a normal run's walls."
    )


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

    peak_memory_bytes: int | None = Field(
        default=None, description="The step container's peak memory."
    )
    peak_memory_source: PeakMemorySource | None = Field(
        default=None,
        description=("Where `peak_memory_bytes` came from (see the model's description)."),
    )
    cpu_seconds: float | None = Field(default=None, description="CPU time of the step's processes.")


class Phases(BaseModel):
    """Seconds spent in each phase, so a slow run says where the time went."""

    prepare_s: float = Field(
        default=0.0, description=("Seconds to prepare the run folder (lock, copies, disk, view).")
    )
    copy_s: float = Field(
        default=0.0, description="Of which: copying the newest real run's execution tree."
    )
    db_copy_s: float = Field(default=0.0, description="Of which: copying the workflow DB.")
    container_start_s: float = Field(
        default=0.0,
        description=("Seconds to start the guard and step containers (firewall included)."),
    )
    step_s: float = Field(default=0.0, description="Seconds the step ran.")
    collect_s: float = Field(
        default=0.0,
        description=(
            "Seconds to collect: output, file changes, DB diff, copies off the "
            "disk, the action log."
        ),
    )


class RunnerInfo(BaseModel):
    """Who ran this record's run; lets `gc` tell an orphaned run from a live one.

    `create_time` is the runner's start in wall-clock seconds (psutil's figure), which a
    clock step moves (Linux derives the boot time from the wall clock at every read);
    `start_ticks` (clock ticks since boot) and `boot_id` name the same start in terms no
    clock moves, and are what `gc` compares when they are there (records written before
    they were added have neither)."""

    pid: int = Field(description="The runner's process id.")
    create_time: float = Field(
        description=("The runner's start, wall-clock seconds (a clock step moves it).")
    )
    hostname: str = Field(description="The host the runner ran on.")
    start_ticks: int | None = Field(
        default=None, description="The runner's start in clock ticks since boot."
    )
    boot_id: str | None = Field(
        default=None, description="The kernel's boot id when the runner started."
    )


class Preflight(BaseModel):
    """What the step's namespace looked like just before the step started."""

    ok: bool = Field(description="Every way out the preflight tried was closed.")
    firewall_verified: bool = Field(
        default=False,
        description=("The checks that need the firewall ran once the guard listened."),
    )
    ms: float | None = Field(default=None, description="Milliseconds the preflight took.")
    checks: list[str] = Field(default_factory=empty_list, description="The checks it made.")
    open: list[str] = Field(
        default_factory=empty_list,
        description="Ways out it found open (then the step never started).",
    )


class Landlock(BaseModel):
    """The Landlock wall the executor put on itself before the step started.

    `required`: the backend runs no step without it (Pods, unless the host config's
    `[backend] run_without_landlock`); else it is a second wall where the kernel has
    it. `abi`: the kernel's Landlock ABI, None without one. `applied`: writes were
    confined to the group folder, the DB copy's folder, /tmp, /dev/shm and a few
    device nodes. `scoped`: IPC kept inside the step (`abstract_unix_socket`,
    `signal`; ABI 6 and later). `reason`: why it was not applied. All defaults: the
    executor did not report (a run that never reached it, or a record from before)."""

    required: bool = Field(default=False, description="The backend runs no step without Landlock.")
    abi: int | None = Field(
        default=None, description="The kernel's Landlock ABI; null without one."
    )
    applied: bool = Field(
        default=False, description="Writes were confined to the step's own folders."
    )
    scoped: list[str] = Field(
        default_factory=empty_list,
        description=("IPC scopes kept inside the step (`abstract_unix_socket`, `signal`)."),
    )
    reason: str = Field(default="", description="Why Landlock was not applied.")


class StubbedAction(BaseModel):
    """One line of the result's opening summary: every stubbed call of one tool (of one
    egress host, for `http`), grouped, so no distinct tool is lost however many calls
    came before it.

    `reason` and `detail` are the first call's; `count` is exact; `first_*`/`last_*`
    give the first and last call's 1-based line in the step's action log and a digest
    of its arguments (`sandbox.collect.stubgroups.args_digest`). A record written
    before the grouping holds one entry per call (the defaults: count 1, lines 0)."""

    tool: str = Field(
        description=("The stubbed tool (`http` for egress, `mcp:<server>/<tool>` for MCP).")
    )
    reason: str = Field(description="The first call's reason.")
    detail: str = Field(default="", description="The first call's detail (e.g. the egress URL).")
    host: str = Field(default="", description="For `http`: the egress host.")
    category: str = Field(default="", description="The effects-table row (e.g. `messaging`).")
    count: int = Field(default=1, description="Exactly how many calls of this tool were stubbed.")
    first_line: int = Field(
        default=0, description="The first call's 1-based line in the action log."
    )
    last_line: int = Field(default=0, description="The last call's 1-based line in the action log.")
    first_args: str = Field(default="", description="A digest of the first call's arguments.")
    last_args: str = Field(default="", description="A digest of the last call's arguments.")
    last_detail: str = Field(default="", description="The last call's detail.")


class StubbedCut(BaseModel):
    """What the stubbed list left out, never silently: whole groups only (tools outside
    the effects table, past a cap a hostile step could otherwise make a record of
    millions of names), counted here with their calls."""

    groups: int = Field(
        default=0,
        description=(
            "Whole tool groups left out of `stubbed` (only tools outside the "
            "effects table, past the cap)."
        ),
    )
    calls: int = Field(default=0, description="Their calls.")


def stubbed_lines(
    stubbed: Sequence[StubbedAction], cut: StubbedCut, total: int, unlogged: int | None
) -> list[str]:
    """The opening summary's stubbed list: each group with its exact count and log
    lines, then what was cut and any call the list cannot account for."""
    if not total and not stubbed and not unlogged:
        return ["no action was stubbed"]
    tools = len(stubbed) + cut.groups
    lines = [f"{total} call(s) were stubbed (would have run), {tools} distinct tool(s):"]
    for a in stubbed:
        where = ""
        if a.first_line:
            where = (
                f" (log line {a.first_line})"
                if a.count == 1
                else f" (log lines {a.first_line}..{a.last_line})"
            )
        step_id = getattr(a, "step_id", "")  # a chain's list names the step
        step = f"[{step_id}] " if step_id else ""
        host = f" {a.host}" if a.host else ""
        lines.append(
            f"  - {step}{a.tool}{host} x{a.count}: {a.reason}"
            + (f" [{a.detail}]" if a.detail else "")
            + where
        )
    if cut.groups:
        lines.append(
            f"  - {cut.groups} more tool(s) with {cut.calls} call(s), cut from this list "
            "(the action log has every line)"
        )
    listed = sum(a.count for a in stubbed) + cut.calls
    if total > listed:
        lines.append(f"  - {total - listed} more call(s) not listed (see the action log)")
    if unlogged:
        lines.append(f"  - {unlogged} call(s) stubbed without a line (the action log was full)")
    return lines


class ActionCounts(BaseModel):
    """How many guarded calls got each decision (from the action log).

    Each call counts once (a forwarded call's `start` line, or its one line).
    `outcome_error`: forwarded calls whose outcome was an error;
    `outcome_unknown`: forwarded calls with no outcome line (the guard stopped
    mid-call). `log_full`: the log reached its cap, and the guard stubbed every
    later call without a line; `stubbed_unlogged` says how many, when the guard
    lived to write it."""

    allow: int = Field(default=0, description="Calls allowed (each counted once).")
    stub: int = Field(default=0, description="Calls stubbed: the exact total.")
    redirect: int = Field(default=0, description="Calls redirected into the test run's copy (DB).")
    refuse: int = Field(default=0, description="Calls refused.")
    malformed: int = Field(default=0, description="Action-log lines that did not parse.")
    truncated: bool = Field(default=False, description="The log was cut at its size cap.")
    outcome_error: int = Field(default=0, description="Forwarded calls whose outcome was an error.")
    outcome_unknown: int = Field(
        default=0,
        description=("Forwarded calls with no outcome line (the guard stopped mid-call)."),
    )
    log_full: bool = Field(
        default=False,
        description=("The log reached its cap; later calls were stubbed without a line."),
    )
    stubbed_unlogged: int | None = Field(
        default=None,
        description=("How many calls were stubbed without a line, when the guard lived to say."),
    )
    # Redirected calls whose SQL is not a read: writes into the test run's DB copy
    # (None: a record from before they were counted).
    redirect_write: int | None = Field(
        default=None,
        description=(
            "Redirected calls whose SQL is not a read: writes into the DB copy "
            "(null in records from before they were counted)."
        ),
    )

    def add(self, decision: str) -> None:
        if decision in {"allow", "stub", "redirect", "refuse"}:
            setattr(self, decision, getattr(self, decision) + 1)


class UnfinishedCall(BaseModel):
    """A call the guard forwarded (its `start` line) but never wrote an outcome for:
    started, outcome unknown."""

    call_id: str = Field(description="The call's id in the action log.")
    tool: str = Field(description="The tool called.")
    decision: str = Field(description="The guard's decision.")
    reason: str = Field(description="The decision's reason.")
    started_at: datetime = Field(description="When its start line was written.")
    detail: str = Field(default="", description="Its detail (e.g. the URL).")


class McpServerReport(BaseModel):
    """A stdio MCP server's container at the end of the run (it ran as `uid`).

    `stderr_file` (relative to the run root) is its stderr as the host read it
    back from the engine, capped at `stderr_bytes`."""

    uid: int = Field(description="The uid the server ran as.")
    exit_code: int | None = Field(
        default=None, description=("Its exit code; null: it was still running when the run ended.")
    )  # None: it was still running when the run ended
    stderr_file: str = Field(default="", description="Its stderr, relative to the run root.")
    stderr_bytes: int = Field(default=0, description="Bytes of stderr kept.")
    stderr_truncated: bool = Field(default=False, description="Its stderr was cut at the cap.")


class ContentHash(BaseModel):
    """What defined the step in this run, hashed (`sandbox.prepare.contenthash`, whose
    docstring is the definition): `parts` by name (each file of the workflow folder that
    is not data, each `workflow.toml` section, the command, the policy table, the
    images), `digest` over all of them. A verification counts for this digest only.
    `complete` is False when something could not be hashed (`not_covered` says what):
    the gate never passes such a version. (False by default: a hash that does not say
    it covered everything is taken not to have.)"""

    digest: str = Field(description="The step's version: one digest over every part.")
    parts: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Each part of the version by name (files, `workflow.toml` sections,"
            " the command, the policy table, the images) and its hash."
        ),
    )
    complete: bool = Field(
        default=False,
        description=("Everything was covered; the gate passes no version without it."),
    )
    not_covered: list[str] = Field(
        default_factory=empty_list, description="What could not be hashed."
    )


class TestRunRecord(BaseModel):
    """`runs/test-<id>/test_mode.json`."""

    model_config = ConfigDict(title="TestRunRecord")
    __test__ = False  # a model, not a pytest test class

    schema_version: Literal[1] = Field(
        default=SCHEMA_VERSION, description="The record's schema version."
    )
    test_mode: Literal[True] = Field(default=True, description="Always true: a test run's record.")
    runner_version: str | None = Field(
        default=None,
        description=("The sandbox version that wrote the record (null: before it was recorded)."),
    )
    id: str = Field(description="The test run's id (`runs/test-<id>/`).")
    # The whole-workflow test run this step ran in (its `runs/test-<id>/`), if any.
    workflow_run_id: str | None = Field(
        default=None, description="The whole-workflow test run this step ran in, if any."
    )
    workflow_dir: str = Field(description="The workflow folder.")
    workflow_name: str = Field(description="The workflow's name.")
    step_id: str = Field(description="The step.")
    group: str = Field(description="The step's group folder.")
    command: str = Field(description="The command that ran, as one line.")
    status: RunStatus = Field(description="How the run ended (`running` while it runs).")
    reason: str = Field(default="", description="Why it ended so, in words.")
    started_at: datetime = Field(description="When the run started.")
    finished_at: datetime | None = Field(default=None, description="When it ended.")
    duration_s: float | None = Field(default=None, description="Its wall time.")
    exit_code: int | None = Field(default=None, description="The step's exit code.")
    stdout: OutputTail = Field(
        default_factory=OutputTail, description="The end of the step's stdout."
    )
    stderr: OutputTail = Field(
        default_factory=OutputTail, description="The end of the step's stderr."
    )
    guard_log: OutputTail = Field(
        default_factory=OutputTail, description="The end of the guard's own output."
    )
    copy_report: CopyReport | None = Field(
        default=None,
        description=("The copy of the newest real run's execution tree into the group folder."),
    )
    no_earlier_run: bool = Field(
        default=False, description="There was no real run: the group folder started empty."
    )
    db_copy: DbCopyReport | None = Field(default=None, description="The copy of the workflow DB.")
    no_db: bool = Field(
        default=False, description="The workflow has no DB: the step had no DB access."
    )
    db_diff: DbDiff | None = Field(
        default=None, description="The row-level diff of the DB copy against the real DB."
    )
    files: FileChanges = Field(
        default_factory=FileChanges, description="What the step did to its group folder."
    )
    resources: Resources = Field(default_factory=Resources, description="Peak memory and CPU.")
    preflight: Preflight | None = Field(default=None, description="The preflight's result.")
    landlock: Landlock = Field(
        default_factory=Landlock, description="The Landlock wall the run had."
    )
    # The most the step's disk held (its folders and /tmp, the copies it started with
    # included), sampled while it ran and at the end.
    disk_used_bytes: int | None = Field(
        default=None,
        description=("The most the step's disk held, sampled while it ran and at the end."),
    )
    # The copy of the group folder and the DB copy off the step's disk into the run
    # folder: what was copied and what was left out (special files, the cap).
    export_report: CopyReport | None = Field(
        default=None,
        description=(
            "The copy of the group folder and DB copy off the step's disk into the run folder."
        ),
    )
    phases: Phases = Field(default_factory=Phases, description="Seconds per phase.")
    # Every stubbed call, one group per tool in the order of its first call; what a cap
    # left out is counted in `stubbed_cut` (`actions.stub` is the exact total).
    stubbed: list[StubbedAction] = Field(
        default_factory=empty_list,
        description=("Every stubbed call, grouped by tool in the order of its first call."),
    )
    stubbed_cut: StubbedCut = Field(
        default_factory=StubbedCut, description="What a cap left out of `stubbed`."
    )
    actions: ActionCounts = Field(
        default_factory=ActionCounts, description="Guarded calls per decision, from the action log."
    )
    outcome_unknown: list[UnfinishedCall] = Field(
        default_factory=empty_list, description="Calls started with no outcome line."
    )
    mcp_servers: dict[str, McpServerReport] = Field(
        default_factory=dict, description="Each stdio MCP server's container at the end."
    )
    egress: dict[str, EgressCounts] = Field(
        default_factory=dict, description="Egress requests per host."
    )
    dns: DnsQueries = Field(
        default_factory=DnsQueries,
        description="The step's DNS queries, all answered by the guard's own DNS.",
    )
    packets: RefusedPackets = Field(
        default_factory=RefusedPackets,
        description="What the step sent besides TCP and DNS: refused at once, and counted.",
    )
    actions_log: str = Field(
        default=ACTIONS_FILE, description="The action log's file name in the run folder."
    )
    # When the runner synced the action log to disk once the guard was gone (the seal):
    # None means the log was not sealed, and verify, gate and report refuse the record.
    log_synced_at: datetime | None = Field(
        default=None,
        description=(
            "When the runner synced the action log once the guard was gone (the"
            " seal); null: not sealed, and verify, gate and report refuse the "
            "record."
        ),
    )
    runner: RunnerInfo | None = Field(
        default=None,
        description=("Who ran the run (lets `sandbox gc` tell an orphan from a live run)."),
    )
    images: dict[str, str] = Field(default_factory=dict, description="The images' ids, by role.")
    walls: Walls = Field(default_factory=Walls, description="The walls the run had.")
    content: ContentHash | None = Field(
        default=None, description="The step's version: what defined it in this run, hashed."
    )
    # The engine that ran the containers, and on Kubernetes the node the Pod ran on.
    backend: Literal["docker", "kubernetes"] = Field(
        default="docker", description="The engine that ran the containers."
    )
    node: str | None = Field(default=None, description="On Kubernetes: the node the Pod ran on.")
    recording: RecordingSummary | None = Field(
        default=None,
        description="The reads this run kept (its cap, and what was not kept); none: none kept.",
    )
    replay: ReplaySummary | None = Field(
        default=None,
        description=(
            "The recording this run replayed its reads from (its run and index digest), and "
            "every read it did not have; none: a live run."
        ),
    )

    def summary_lines(self) -> list[str]:
        """The result starts with every stubbed action, then the verdict."""
        lines = [f"test run {self.id}: step {self.step_id} {self.status.value}"]
        if self.replay is not None:
            lines.append(
                f"REPLAYED from {self.replay.run_id}'s recording: {self.replay.hits} hit(s), "
                f"{self.replay.misses} miss(es)"
            )
        # A full log's unlogged stubs have their own line below.
        lines += stubbed_lines(self.stubbed, self.stubbed_cut, self.actions.stub, None)
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
        unknown = max(counts.outcome_unknown, len(self.outcome_unknown))
        if unknown:
            lines.append(
                f"{unknown} call(s) started, outcome unknown "
                "(the guard stopped before it wrote their outcome):"
            )
            lines.extend(
                f"  - {c.tool}" + (f" [{c.detail}]" if c.detail else "")
                for c in self.outcome_unknown
            )
            if unknown > len(self.outcome_unknown):
                lines.append(f"  - {unknown - len(self.outcome_unknown)} more (see the action log)")
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
        if self.packets.attempts or self.packets.counts_short:
            aims = [
                f"{p.protocol} {p.destination}"
                + (f" port {p.port}" if p.port else "")
                + f" x{p.count}"
                for p in self.packets.destinations[:5]
            ]
            more = len(self.packets.destinations) - len(aims) + self.packets.not_listed
            lines.append(
                f"refused packets: {self.packets.attempts} (nothing left the run): "
                + "; ".join(aims)
                + (f"; {more} more destination(s)" if more else "")
                + ("; counts short (a flood)" if self.packets.counts_short else "")
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
