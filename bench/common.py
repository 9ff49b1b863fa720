"""What every benchmark shares: sizes, the bench's own containers and network, the
fake upstream, held test runs, and the client programs (`bench/programs/`, stdlib
only: they run inside containers of the step or MCP image)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sqlite3
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker.errors
from docker import DockerClient
from docker.types import Mount as DockerMount
from pydantic import BaseModel

from bench.results import BenchResults
from sandbox.backends.docker.images import REPO_ROOT
from sandbox.contracts.config import load_workflow
from sandbox.contracts.layout import STEP_UID, TEST_RUN_PREFIX, RunLayout
from sandbox.contracts.names import STEP_IMAGE
from sandbox.contracts.record import TestRunRecord
from sandbox.run.testrun import RunOptions, TestRun

PROGRAMS = Path(__file__).resolve().parent / "programs"


def program(name: str) -> str:
    """The text of a client program in `bench/programs/`."""
    return (PROGRAMS / name).read_text()


SERVER_PATH = REPO_ROOT / "examples" / "job-board" / "fake_api" / "server.py"
UPSTREAM_PORT = 8080
BENCH_LABEL = "sandbox.bench"
MIB = 1024**2


# Sizes. `--quick` shrinks them for developing the bench itself (its results are not written
class Sizes(BaseModel):
    startup_n: int = 7
    copy_mib: int = 400
    copy_reps: int = 7
    db_mib: int = 200
    db_wal_mib: int = 20
    db_reps: int = 3
    guard_rounds: int = 3
    guard_seq_n: int = 700  # per round and target: 2,100 timed calls each way
    guard_conc_procs: int = 4
    guard_conc_n: int = 250  # per client per round
    guard_stub_n: int = 300
    guard_sync_n: int = 300  # per round: the log's sync alone
    scale_runs: int = 10
    egress_big_mib: int = 100
    egress_small_n: int = 300
    egress_rounds: int = 3
    mcp_n: int = 300
    mcp_rounds: int = 3
    exec_calls: int = 600  # of each kind


QUICK = Sizes(
    startup_n=5,
    copy_mib=40,
    copy_reps=3,
    db_mib=20,
    db_wal_mib=4,
    db_reps=1,
    guard_rounds=1,
    guard_seq_n=200,
    guard_conc_n=100,
    guard_stub_n=100,
    guard_sync_n=100,
    scale_runs=3,
    egress_big_mib=10,
    egress_small_n=100,
    egress_rounds=1,
    mcp_n=50,
    mcp_rounds=1,
    exec_calls=100,
)


class BenchError(Exception):
    """A benchmark could not produce its figure (its rows say `failed` and why)."""


POST_CLIENT = program("post_client.py")


GET_CLIENT = program("get_client.py")
DNS_CLIENT = program("dns_client.py")


MCP_SDK_CLIENT = program("mcp_sdk_client.py")


HOLD_STEP = program("hold_step.py")


SCALE_STEP = program("scale_step.py")


@dataclass(frozen=True)
class Upstream:
    """The job-board example's fake API (the real bridge's stand-in), run by the bench."""

    network: str
    address: str  # its address on `network`, reachable from the host
    container_id: str

    @property
    def url(self) -> str:
        return f"http://{self.address}:{UPSTREAM_PORT}"


FAST_UPSTREAM = program("fast_upstream.py")


@contextlib.contextmanager
def bench_network(b: Bench) -> Iterator[str]:
    """An internal bridge network of the bench's own (no route out), removed on exit."""
    network = b.client.networks.create(
        f"sandbox-bench-{secrets.token_hex(4)}",
        driver="bridge",
        internal=True,
        labels={BENCH_LABEL: b.bench_id},
    )
    try:
        yield str(network.name)
    finally:
        b.cleanup()
        with contextlib.suppress(docker.errors.APIError):
            network.remove()


def address_on(b: Bench, container_id: str, network: str) -> str:
    attrs = b.client.api.inspect_container(container_id)
    return str(attrs["NetworkSettings"]["Networks"][network]["IPAddress"])


@contextlib.contextmanager
def upstream_server(b: Bench) -> Iterator[Upstream]:
    """The fake job-board API in a container on a bench network, alias `jobboard`: the
    example's tools behind a lean asyncio front (`programs/fast_upstream.py`), so the
    baseline measures the network path, not the example's threaded server."""
    with bench_network(b) as network:
        container = b.client.containers.create(
            STEP_IMAGE,
            ["python3", "-c", FAST_UPSTREAM, "--host", "0.0.0.0", "--port", str(UPSTREAM_PORT)],
            user=f"{STEP_UID}:{STEP_UID}",
            labels={BENCH_LABEL: b.bench_id},
            mounts=[DockerMount("/srv/server.py", str(SERVER_PATH), type="bind", read_only=True)],
            network=network,
            networking_config={network: b.client.api.create_endpoint_config(aliases=["jobboard"])},
            detach=True,
        )
        try:
            container.start()
            up = Upstream(network, address_on(b, str(container.id), network), str(container.id))
            wait_for("the fake upstream to answer", lambda: healthy(up.url + "/health"), 30)
            yield up
        finally:
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)


def healthy(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def wait_for(what: str, probe: Callable[[], Any], deadline_s: float, poll_s: float = 0.02) -> Any:
    """Poll `probe` until it returns something truthy, or fail after `deadline_s`."""
    end = time.monotonic() + deadline_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > end:
            raise BenchError(f"timed out after {deadline_s:g} s waiting for {what}")
        time.sleep(poll_s)


class Background:
    """Run one callable in a thread; join with a deadline; re-raise what it raised."""

    def __init__(self, target: Callable[[], TestRunRecord]) -> None:
        self._target = target
        self.result: TestRunRecord | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.result = self._target()
        except BaseException as exc:
            self.error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, deadline_s: float) -> TestRunRecord:
        self._thread.join(deadline_s)
        if self._thread.is_alive():
            raise BenchError(f"a test run did not finish within {deadline_s:g} s")
        if self.error is not None:
            raise BenchError(f"the test run raised: {self.error}") from self.error
        assert self.result is not None
        return self.result


def execute(wf: Path, step: str, options: RunOptions) -> TestRunRecord:
    return TestRun(wf, step, options).execute()


def write_workflow(
    wf: Path,
    *,
    name: str,
    step: str,
    command: list[str],
    timeout_s: float = 120,
    extra_toml: str = "",
    code: dict[str, str] | None = None,
) -> Path:
    (wf / "code").mkdir(parents=True)
    (wf / "workflow.toml").write_text(
        f'name = "{name}"\n\n[[steps]]\nid = "{step}"\ngroup = "g"\n'
        f"command = {json.dumps(command)}\ntimeout_s = {timeout_s}\n\n{extra_toml}"
    )
    for file_name, text in (code or {}).items():
        path = wf / "code" / file_name
        path.write_text(textwrap.dedent(text))
        path.chmod(0o644)
    return wf


def small_db(path: Path, rows: int = 100) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT, done INTEGER)")
        con.executemany(
            "INSERT INTO items (name, done) VALUES (?, ?)",
            [(f"item {i}", i % 2) for i in range(rows)],
        )
        con.commit()
    finally:
        con.close()


def earlier_run(wf: Path, files: int, each_bytes: int) -> None:
    execution = wf / "runs" / "run-1" / "g" / "execution"
    (execution / "notes").mkdir(parents=True)
    for i in range(files):
        (execution / "notes" / f"n{i:03}.txt").write_bytes(os.urandom(each_bytes))


def tree_bytes(root: Path) -> tuple[int, int]:
    """(regular-file bytes, regular files) under root, links not followed."""
    total = files = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if not os.path.islink(os.path.join(dirpath, name)):
                total += st.st_size
                files += 1
    return total, files


class Bench:
    """One `sandbox bench` run: the engine, a scratch folder, and what must be cleaned up."""

    def __init__(self, client: DockerClient, work: Path, sizes: Sizes, results: BenchResults):
        self.client = client
        self.work = work
        self.sizes = sizes
        self.results = results
        self.bench_id = work.name
        self.t0 = time.monotonic()

    def say(self, message: str) -> None:
        print(f"[bench {time.monotonic() - self.t0:6.1f}s] {message}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        self.results.notes.append(text)

    # -- containers the bench itself makes -------------------------------------------------------

    def helper(
        self,
        *,
        netns_of: str | None,
        user: int,
        script: str,
        cfg: dict[str, Any],
        timeout_s: float = 300,
        image: str = STEP_IMAGE,
        python: str = "python3",
    ) -> dict[str, Any]:
        """Run `script` with `python` in a container of `image` inside `netns_of`'s network
        namespace (None: no network), as `user`, with the step's default CPU limit; its last
        stdout line is JSON."""
        path = self.work / f"client-{abs(hash(script)) % 10**8}.py"
        if not path.exists():
            path.write_text(script)
            path.chmod(0o644)
        container = self.client.containers.create(
            image,
            ["/bench/client.py", json.dumps(cfg)],
            entrypoint=[python],
            environment={"HOME": "/tmp"},
            user=f"{user}:{user}",
            network_mode="none" if netns_of is None else f"container:{netns_of}",
            mounts=[DockerMount("/bench/client.py", str(path), type="bind", read_only=True)],
            labels={BENCH_LABEL: self.bench_id},
            nano_cpus=10**9,
            mem_limit=256 * MIB,
            detach=True,
        )
        try:
            container.start()
            status = container.wait(timeout=timeout_s)
            out = container.logs(stdout=True, stderr=False).decode(errors="replace")
            if status.get("StatusCode") != 0:
                err = container.logs(stdout=False, stderr=True).decode(errors="replace")
                tail = " | ".join(err.strip().splitlines()[-3:])
                raise BenchError(f"bench client failed (exit {status.get('StatusCode')}): {tail}")
            result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
            return result
        finally:
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)

    def run_containers(self, run_root: Path) -> dict[str, dict[str, Any]]:
        """role -> inspect data of the test run's live containers."""
        found = self.client.api.containers(filters={"label": [f"sandbox.run-root={run_root}"]})
        out: dict[str, dict[str, Any]] = {}
        for item in found:
            role = item.get("Labels", {}).get("sandbox.role", "")
            out[role] = self.client.api.inspect_container(item["Id"])
        return out

    def kill_runs_under(self, root: Path) -> None:
        """Stop every step container of our test runs under `root` (after a bench failure)."""
        for item in self.client.api.containers(filters={"label": ["sandbox.role=step"]}):
            if item.get("Labels", {}).get("sandbox.run-root", "").startswith(str(root)):
                with contextlib.suppress(docker.errors.APIError):
                    self.client.api.kill(item["Id"])

    def cleanup(self) -> None:
        for item in self.client.api.containers(
            all=True, filters={"label": [f"{BENCH_LABEL}={self.bench_id}"]}
        ):
            with contextlib.suppress(docker.errors.APIError):
                self.client.api.remove_container(item["Id"], force=True)
        for net in self.client.api.networks(filters={"label": [f"{BENCH_LABEL}={self.bench_id}"]}):
            with contextlib.suppress(docker.errors.APIError):
                self.client.api.remove_network(net["Id"])


STARTUP_MCP_CALL = program("startup_mcp_call.py")


@dataclass
class Held:
    """A live test run whose step (HOLD_STEP) waits until the bench releases it."""

    workflow: str
    run_root: Path
    guard_id: str
    token: str
    record: TestRunRecord | None = None


@contextlib.contextmanager
def held_run(b: Bench, run: TestRun) -> Iterator[Held]:
    """Start `run`, yield once its step says ready; release it (or kill it) on the way out."""
    wf = run.workflow_dir
    group = load_workflow(wf).step(run.step_id).group
    runner = Background(run.execute)
    held: Held | None = None

    def disk_groups() -> list[RunLayout]:
        """Each test run's layout: while its step runs, its group folder is on its disk."""
        roots = sorted((wf / "runs").glob(f"{TEST_RUN_PREFIX}*"))
        return [RunLayout(wf, root.name, group) for root in roots]

    def ready() -> RunLayout | None:
        if runner.done():
            record = runner.join(1)
            raise BenchError(f"the held run ended early: {record.status.value}: {record.reason}")
        return next((lay for lay in disk_groups() if (lay.disk_group / "ready").exists()), None)

    try:
        layout: RunLayout = wait_for("the held run's step to be ready", ready, 180)
        run_root = layout.root
        live = b.run_containers(run_root)
        env = dict(e.split("=", 1) for e in live["step"]["Config"]["Env"])
        held = Held(
            workflow=wf.name,
            run_root=run_root,
            guard_id=str(live["guard"]["Id"]),
            token=env["AGENTWORKS_BRIDGE_TOKEN"],
        )
        yield held
    finally:
        for each in disk_groups():
            with contextlib.suppress(OSError):
                (each.disk_group / "release").touch()
        try:
            record = runner.join(60)
        except BenchError:
            b.kill_runs_under(wf)
            record = runner.join(120)
        if held is not None:
            held.record = record


def hold_workflow(b: Bench, name: str, calls: int, extra_toml: str) -> Path:
    return write_workflow(
        b.work / name,
        name=name,
        step="hold",
        command=["python3", "/workflow/code/hold.py", str(calls), "generate_text_llm", "400"],
        timeout_s=450,
        extra_toml=extra_toml,
        code={"hold.py": HOLD_STEP},
    )


SYNC_LINE_BYTES = 600  # about one forwarded call's start line


def log_sync_alone(where: Path, n: int, gap_s: float = 0.0) -> list[int]:
    """The durability floor on the runs' disk: `n` lines, each appended with write(2)
    and fdatasync'ed, as the guard's log writer does for a lone call (microseconds per
    line); back to back, or `gap_s` apart (untimed). A forwarded call's reply waits for
    one such sync."""
    path = where / "sync-alone.jsonl"
    line = b'{"event":"start",' + b'"x":"' + b"x" * (SYNC_LINE_BYTES - 24) + b'"}\n'
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    samples = []
    try:
        for _ in range(n):
            if gap_s:
                time.sleep(gap_s)
            t = time.perf_counter_ns()
            os.write(fd, line)
            os.fdatasync(fd)
            samples.append((time.perf_counter_ns() - t) // 1000)
    finally:
        os.close(fd)
        path.unlink()
    return samples
