"""Shared fixtures: the real Docker engine, and workflow folders made to order.

Tests marked `engine` talk to the real engine (never a mock); they fail, not
skip, when it is missing, because `make test` installs and starts it. The mark is
given here to every test that uses the `engine` fixture and to `tests/scenarios/`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sqlite3
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest
from docker import DockerClient
from docker.models.containers import Container

from sandbox.backends import BackendFactory
from sandbox.backends.docker import images
from sandbox.backends.docker.gc import orphaned
from sandbox.contracts import names
from sandbox.contracts.config import load_workflow
from sandbox.contracts.guardconfig import GuardConfig
from sandbox.contracts.hostconfig import Durability
from sandbox.contracts.layout import TEST_RUN_PREFIX, RunLayout
from sandbox.contracts.names import LABEL_MANAGED, LABEL_RUN_ROOT, LABEL_RUNNER_PID
from sandbox.contracts.record import TestRunRecord
from sandbox.contracts.wire import ActionLine
from sandbox.guard.actionlog import ActionLog
from sandbox.run.testrun import RunOptions, TestRun

# Second engines (runsc runtimes, userns-remap) for the tests of the second walls.
from tests.engines.fixtures import (  # noqa: F401
    runsc_engine,
    second_engines,
    userns_engine,
    wall_engine,
)

# The helpers test modules share assert as tests do: pytest explains their failures too.
pytest.register_assert_rewrite(
    "tests.collect.logparts",
    "tests.guard.actionlogparts",
    "tests.guard.bridge.bridgeparts",
    "tests.guard.egress.proxyparts",
    "tests.guard.mcp.mcpparts",
    "tests.kubernetes.battery",
    "tests.kubernetes.fleetparts",
    "tests.kubernetes.pods",
    "tests.launch.specparts",
    "tests.scenarios.egressparts",
    "tests.scenarios.workflowparts",
    "tests.security.filesystemparts",
    "tests.verify.recordparts",
)

SCENARIOS = Path(__file__).resolve().parent / "scenarios"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `engine` every test that asks for the real engine, however indirectly, and
    every whole-run scenario, so `-m engine` / `-m "not engine"` split the suite by what
    it needs without each file having to say so.

    The long soak and the engine restart run only on request (`-m soak`, `-m
    engine_restart`), the restart last: it stops every container on the engine,
    everyone's on a shared host."""
    markexpr = config.getoption("markexpr", "") or ""
    for item in items:
        if "engine" in getattr(item, "fixturenames", ()) or item.path.is_relative_to(SCENARIOS):
            item.add_marker(pytest.mark.engine)
        if item.get_closest_marker("soak") is not None and "soak" not in markexpr:
            item.add_marker(pytest.mark.skip(reason="the 100-run soak runs with -m soak"))
        if item.get_closest_marker("engine_restart") is not None and (
            "engine_restart" not in markexpr
        ):
            item.add_marker(
                pytest.mark.skip(reason="restarts the host's dockerd; runs with -m engine_restart")
            )
    items.sort(key=lambda item: item.get_closest_marker("engine_restart") is not None)


@pytest.fixture(scope="session")
def engine() -> Iterator[DockerClient]:
    client = docker.from_env(timeout=120)
    client.ping()
    images.require(client, names.STEP_IMAGE)
    yield client
    # Ours are the runs of this process, and any run whose runner is gone; runs of
    # other processes on the same engine (a developer's, a parallel suite) are theirs.
    leftovers = [
        c.name
        # Other suites' containers come and go on the shared engine while this lists.
        for c in client.containers.list(
            all=True, filters={"label": LABEL_MANAGED}, ignore_removed=True
        )
        if c.labels.get(LABEL_RUNNER_PID) == str(os.getpid()) or orphaned(c.labels)
    ]
    assert not leftovers, f"containers left behind: {leftovers}"


WorkflowFactory = Callable[..., Path]


def containers_of(client: DockerClient, workflow_dir: Path, *, all: bool = False) -> list[Any]:
    """The sandbox containers of runs of one workflow (never another suite's)."""
    prefix = str(workflow_dir.absolute() / "runs") + "/"
    return [
        c
        for c in client.containers.list(
            all=all, filters={"label": LABEL_MANAGED}, ignore_removed=True
        )
        if c.labels.get(LABEL_RUN_ROOT, "").startswith(prefix)
    ]


DEFAULT_DB_SQL = "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT); INSERT INTO t VALUES (1, 'one');"


def write_workflow(
    root: Path,
    name: str = "wf",
    *,
    command: str | list[str] = "true",
    group: str = "g",
    timeout_s: float = 60,
    db_sql: str | None = DEFAULT_DB_SQL,
    earlier_files: dict[str, str] | None = None,
    extra_toml: str = "",
    prompt: str | None = None,
) -> Path:
    """Build `<root>/<name>/` with a workflow.toml, optional DB and earlier run."""
    wf = root / name
    (wf / "code").mkdir(parents=True)
    cmd = json.dumps(command)  # a JSON string or array of strings is valid TOML
    prompt_line = 'prompt_file = "prompt.md"' if prompt is not None else ""
    (wf / "workflow.toml").write_text(
        textwrap.dedent(
            f"""\
            name = "{name}"
            [[steps]]
            id = "step1"
            group = "{group}"
            command = {cmd}
            timeout_s = {timeout_s}
            {prompt_line}
            """
        )
        + extra_toml
    )
    if prompt is not None:
        (wf / "prompt.md").write_text(prompt)
    if db_sql is not None:
        (wf / "db").mkdir()
        con = sqlite3.connect(wf / "db" / "db.sqlite")
        con.executescript(db_sql)
        con.commit()
        con.close()
    if earlier_files is not None:
        execution = wf / "runs" / "run-1" / group / "execution"
        execution.mkdir(parents=True)
        for rel, text in earlier_files.items():
            path = execution / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return wf


@pytest.fixture
def make_workflow(tmp_path: Path) -> WorkflowFactory:
    """`write_workflow` rooted in this test's temp folder."""
    return functools.partial(write_workflow, tmp_path)


def tree_digest(root: Path, *, skip_test_runs: bool = True) -> dict[str, str]:
    """Path -> content hash (or link target, or 'dir'), never following links."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames, dirfd in os.fwalk(root, follow_symlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        if skip_test_runs and rel_dir == "runs":
            dirnames[:] = [d for d in dirnames if not d.startswith(TEST_RUN_PREFIX)]
        for name in dirnames:
            if skip_test_runs and rel_dir == "." and name == "runs":
                continue  # a test run may create runs/ itself to hold runs/test-<id>/
            out[os.path.normpath(os.path.join(rel_dir, name))] = "dir"
        for name in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if os.path.islink(os.path.join(dirpath, name)):
                out[rel] = "link:" + os.readlink(name, dir_fd=dirfd)
                continue
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dirfd)
            with os.fdopen(fd, "rb") as handle:
                out[rel] = hashlib.sha256(handle.read()).hexdigest() + f":{st.st_mode:o}"
    return out


class ThreadedRun:
    """One test run in a thread, so a test can act while it runs (kill its guard, read
    its processes, let the step go on). Leaving the block waits for the run to end."""

    def __init__(
        self,
        workflow_dir: Path,
        options: RunOptions | None = None,
        *,
        join_s: float = 180,
        backend: BackendFactory | None = None,
    ) -> None:
        self.workflow_dir = workflow_dir
        self._layout: RunLayout | None = None
        self._join_s = join_s
        self._result: list[TestRunRecord] = []
        self._thread = threading.Thread(
            target=lambda: self._result.append(
                TestRun(workflow_dir, "step1", options, backend=backend).execute()
            )
        )

    def __enter__(self) -> ThreadedRun:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._thread.join(timeout=self._join_s)

    def _ended(self) -> str:
        """How the run ended, for a test that expected it still running."""
        if not self._result:
            return "no record (the run raised)"
        record = self._result[0]
        stderr = record.stderr.text[-2000:] if record.stderr.text else ""
        return f"{record.status.value}: {record.reason}; step stderr (tail): {stderr!r}"

    def wait_for_file(self, pattern: str, deadline_s: float = 120) -> Path:
        """The first path under the workflow's `runs/` matching `pattern`, once it exists
        (for the step's group folder, `wait_for_in_group`)."""
        runs = self.workflow_dir / "runs"
        end = time.monotonic() + deadline_s
        while True:
            found = next(runs.glob(pattern), None) if runs.exists() else None
            if found is not None:
                return found
            assert time.monotonic() < end, f"{pattern} never appeared"
            assert self._thread.is_alive(), (
                f"the run ended before {pattern} appeared: {self._ended()}"
            )
            time.sleep(0.05)

    def wait_for_in_group(self, name: str, deadline_s: float = 120) -> Path:
        """`name` in the step's group folder, once the running step made it.

        While the step runs its group folder is on the run's disk (`RunLayout.disk_group`);
        the run's layout is `self.layout` from then on."""
        group = load_workflow(self.workflow_dir).step("step1").group
        runs = self.workflow_dir / "runs"
        end = time.monotonic() + deadline_s
        while True:
            for root in sorted(runs.glob(f"{TEST_RUN_PREFIX}*")) if runs.exists() else []:
                layout = RunLayout(self.workflow_dir, root.name, group)
                if (layout.disk_group / name).exists():
                    self._layout = layout
                    return layout.disk_group / name
            assert time.monotonic() < end, f"{name} never appeared in the group folder"
            assert self._thread.is_alive(), f"the run ended before {name} appeared: {self._ended()}"
            time.sleep(0.05)

    @property
    def layout(self) -> RunLayout:
        """The run's layout (its run folder found by `wait_for_in_group`)."""
        assert self._layout is not None, "wait_for_in_group first"
        return self._layout

    @staticmethod
    def guard(client: DockerClient, run_id: str) -> Container:
        (guard,) = client.containers.list(
            filters={"label": ["sandbox.role=guard", f"sandbox.run-id={run_id}"]}
        )
        return guard

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()

    @property
    def record(self) -> TestRunRecord:
        (record,) = self._result
        return record


def call_lines(path: Path) -> list[ActionLine]:
    """One line per call (a forwarded call's `start` line, or its one `call` line), each
    start's `outcome` checked to come after it, exactly once; the outcome's detail is
    merged into its call's line (its status, error, sizes)."""
    lines = [ActionLine.model_validate_json(raw) for raw in path.read_text().splitlines()]
    calls: list[ActionLine] = []
    open_calls: dict[str, ActionLine] = {}
    for line in lines:
        if line.event == "outcome":
            assert line.call_id in open_calls, f"an outcome without its start: {line}"
            start = open_calls.pop(line.call_id or "")
            start.detail.update(line.detail)
        else:
            calls.append(line)
            if line.event == "start":
                assert line.call_id not in open_calls, f"call id used twice: {line}"
                open_calls[line.call_id or ""] = line
    assert not open_calls, f"calls without an outcome: {list(open_calls)}"
    return calls


BRIDGE_TOKEN = "b" * 24  # the bridge token of a `guard_config`


def guard_config(actions: Path, **fields: Any) -> GuardConfig:
    """The config of a guard run in this process (its egress proxy, its bridge, its MCP
    proxy): run `test-x`, step `s` of workflow `wf`, tokens of placeholder letters (the
    bridge's is BRIDGE_TOKEN), no database, its action log at `actions` (a file the
    test made), not synced, and its data folder the log's. `fields` add what the test
    is about (an egress allow list, MCP servers) or replace any of these."""
    given: dict[str, Any] = {
        "run_id": "test-x",
        "workflow": "wf",
        "step": "s",
        "bridge_token": BRIDGE_TOKEN,
        "exec_token": "e" * 24,
        "has_db": False,
        "actions_path": str(actions),
        "data_dir": str(actions.parent),
    }
    return GuardConfig(**(given | fields))


@dataclass(frozen=True)
class InProcessGuard:
    """What a guard run in this process is made of: its action log's file, its config
    and its log (which the test closes)."""

    actions: Path
    config: GuardConfig
    log: ActionLog


def in_process_guard(
    tmp_path: Path, *, per_call: bool = False, secrets: tuple[str, ...] = (), **fields: Any
) -> InProcessGuard:
    """A fresh `actions.jsonl` in `tmp_path`, a `guard_config` for it (with `fields`) and
    its log (group commit, or with `per_call` durability per-call), redacting `secrets`."""
    actions = tmp_path / "actions.jsonl"
    actions.touch()
    durability: Durability = "per-call" if per_call else "group"
    config = guard_config(actions, durability=durability, **fields)
    return InProcessGuard(
        actions, config, ActionLog(str(actions), secrets=secrets, durability=durability)
    )
