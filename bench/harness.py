"""`sandbox bench` (`make bench`): how fast test mode is, every figure against a baseline.

Each figure is measured against a baseline taken in the same run, on the same
machine, interleaved with it where that is possible, because these machines
are noisy: the ratio is what a change is judged by; absolute times are printed
too. One table goes to stdout, progress to stderr, and the full results (every
sample, the phase breakdown, the host) to `bench/results.json`.

Benchmarks (see the README's Performance section for what each goal means):

- start-up: a no-op step's whole test run vs one bare `docker run --rm` of the
  step image through the same engine (both via the Docker SDK).
- copy: `copy_execution_tree` of a 400 MiB mixed tree vs `cp -a` of it.
- db copy: `copy_db` of a 200 MiB WAL database vs `sqlite3 SRC .backup DST`.
- guard: an allowed bridge call through the guard vs the same call sent
  straight to the upstream, both from the guard's network namespace.
- scale: 10 test runs at once vs the same 10 one after another.
- mcp / egress: measured when those proxies are built, else "not built yet".

Nothing here is part of `make test`: speed targets live here, not in tests.
Everything the bench creates (a temp dir, containers labelled `sandbox.bench`,
the fake upstreams) is removed before it returns.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import json
import math
import os
import platform
import random
import secrets
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import docker.errors
import psutil
from docker import DockerClient
from docker.types import Mount as DockerMount
from pydantic import BaseModel, Field

from sandbox.backends.docker.client import connect
from sandbox.backends.docker.images import REPO_ROOT
from sandbox.contracts.config import load_workflow
from sandbox.contracts.layout import GUARD_UID, STEP_UID, TEST_RUN_PREFIX, RunLayout
from sandbox.contracts.names import MCP_IMAGE, STEP_IMAGE
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.contracts.wire import RUN_KIND_HEADER, ActionLine
from sandbox.guard.config import BRIDGE_PORT, EGRESS_PORT, MCP_PATH
from sandbox.launch.specs import MCP_SERVER_PATH
from sandbox.prepare.copytree import copy_execution_tree
from sandbox.prepare.dbcopy import copy_db
from sandbox.run.testrun import RunOptions, TestRun

RESULTS_PATH = REPO_ROOT / "bench" / "results.json"
SERVER_PATH = REPO_ROOT / "examples" / "job-board" / "fake_api" / "server.py"
UPSTREAM_PORT = 8080
BENCH_LABEL = "sandbox.bench"
MIB = 1024**2
ALL_BENCHMARKS = ("startup", "copy", "db", "guard", "scale", "mcp", "egress", "chain")

# ---------------------------------------------------------------------------------------------
# Results: pydantic models, the ratio and goal math, and the table. Pure; tested without Docker.
# ---------------------------------------------------------------------------------------------

GoalKind = Literal["ratio_max", "ratio_min", "added_max", "abs_max", "abs_min", "check", "none"]
RowStatus = Literal["measured", "not built yet", "not measured", "failed"]


class Goal(BaseModel):
    """What a figure must reach. `added_max` compares ours - baseline (same unit)."""

    kind: GoalKind = "none"
    threshold: float | None = None
    text: str = "-"

    def met(
        self, ours: float | None, baseline: float | None, check: bool | None = None
    ) -> bool | None:
        """True/False against the goal; None when there is no goal or nothing to judge."""
        if self.kind == "none":
            return None
        if self.kind == "check":
            return check
        if ours is None or self.threshold is None:
            return None
        if self.kind == "abs_max":
            return ours < self.threshold
        if self.kind == "abs_min":
            return ours > self.threshold
        if baseline is None:
            return None
        if self.kind == "added_max":
            return ours - baseline < self.threshold
        r = ratio(ours, baseline)
        if r is None:
            return None
        return r <= self.threshold if self.kind == "ratio_max" else r >= self.threshold


class Row(BaseModel):
    """One line of the table: our figure, the baseline's, their ratio, the goal."""

    key: str
    figure: str
    unit: str
    ours: float | None = None
    baseline: float | None = None
    baseline_name: str = ""
    ratio: float | None = None
    goal: Goal = Field(default_factory=Goal)
    met: bool | None = None
    status: RowStatus = "measured"
    note: str = ""


def ratio(ours: float | None, baseline: float | None) -> float | None:
    """ours / baseline; None when either is missing or the baseline is zero."""
    if ours is None or baseline is None or baseline == 0:
        return None
    return ours / baseline


def make_row(
    key: str,
    figure: str,
    unit: str,
    ours: float | None,
    baseline: float | None,
    goal: Goal | None = None,
    *,
    baseline_name: str = "",
    check: bool | None = None,
    note: str = "",
) -> Row:
    goal = goal or Goal()
    return Row(
        key=key,
        figure=figure,
        unit=unit,
        ours=ours,
        baseline=baseline,
        baseline_name=baseline_name,
        ratio=ratio(ours, baseline),
        goal=goal,
        met=goal.met(ours, baseline, check),
        note=note,
    )


def status_row(
    key: str, figure: str, status: RowStatus, note: str, goal: Goal | None = None
) -> Row:
    """A row for a benchmark that could not measure (not built yet, or failed)."""
    return Row(key=key, figure=figure, unit="", status=status, note=note, goal=goal or Goal())


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "MB/s":
        return f"{value:,.0f} MB/s"
    if unit == "calls/s":
        return f"{value:,.0f} calls/s"
    if unit == "MB":
        return f"{value:.1f} MB"
    return f"{value:g} {unit}".strip()


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def fmt_met(row: Row) -> str:
    if row.status != "measured":
        return row.status
    if row.met is None:
        return "-"
    return "yes" if row.met else "NO"


TABLE_HEADER = ("figure", "ours", "baseline", "ratio", "goal", "met?")


def table_cells(row: Row) -> tuple[str, str, str, str, str, str]:
    baseline = fmt_value(row.baseline, row.unit)
    if row.baseline_name and row.baseline is not None:
        baseline = f"{baseline} ({row.baseline_name})"
    return (
        row.figure,
        fmt_value(row.ours, row.unit),
        baseline,
        fmt_ratio(row.ratio),
        row.goal.text,
        fmt_met(row),
    )


def format_table(rows: list[Row], *, markdown: bool = False) -> str:
    """The one table: plain text with aligned columns, or a GitHub markdown table."""
    cells = [table_cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [TABLE_HEADER, *cells]) for i in range(len(TABLE_HEADER))]

    def line(values: tuple[str, ...]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    out = [line(TABLE_HEADER), line(tuple("-" * w for w in widths))]
    out += [line(c) for c in cells]
    return "\n".join(out)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


class LatencyStats(BaseModel):
    n: int
    median_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float

    @classmethod
    def from_us(cls, samples_us: list[int] | list[float]) -> LatencyStats:
        ms = [s / 1000 for s in samples_us]
        return cls(
            n=len(ms),
            median_ms=round(statistics.median(ms), 4),
            p90_ms=round(percentile(ms, 90), 4),
            p99_ms=round(percentile(ms, 99), 4),
            mean_ms=round(statistics.fmean(ms), 4),
        )


class PhaseBreakdown(BaseModel):
    """One test run's time, from its record's phases; `other_s` is the rest of the wall time
    (engine connect, image check, lock, record writes, container removal)."""

    run_id: str
    wall_s: float
    prepare_s: float
    copy_s: float
    db_copy_s: float
    container_start_s: float
    step_s: float
    collect_s: float
    other_s: float

    @classmethod
    def of(cls, record: TestRunRecord, wall_s: float) -> PhaseBreakdown:
        p = record.phases
        counted = p.prepare_s + p.container_start_s + p.step_s + p.collect_s
        return cls(
            run_id=record.id,
            wall_s=round(wall_s, 4),
            prepare_s=round(p.prepare_s, 4),
            copy_s=round(p.copy_s, 4),
            db_copy_s=round(p.db_copy_s, 4),
            container_start_s=round(p.container_start_s, 4),
            step_s=round(p.step_s, 4),
            collect_s=round(p.collect_s, 4),
            other_s=round(max(0.0, wall_s - counted), 4),
        )

    def text(self) -> str:
        return (
            f"wall {self.wall_s:.3f} s = prepare {self.prepare_s:.3f} (copy {self.copy_s:.3f},"
            f" db copy {self.db_copy_s:.3f}) + container start {self.container_start_s:.3f}"
            f" + step {self.step_s:.3f} + collect {self.collect_s:.3f}"
            f" + other {self.other_s:.3f}"
        )


class StartupDetail(BaseModel):
    n: int
    bare_s: list[float] = Field(default_factory=list)
    noop_s: list[float] = Field(default_factory=list)
    noop_median: PhaseBreakdown | None = None
    with_db_s: list[float] = Field(default_factory=list)
    with_db_median: PhaseBreakdown | None = None
    # The same no-op step with one stdio MCP server configured (its own container),
    # and with a step that makes one call to it.
    with_mcp_s: list[float] = Field(default_factory=list)
    mcp_call_s: list[float] = Field(default_factory=list)


class CopyDetail(BaseModel):
    tree_bytes: int
    files: int
    dirs: int
    symlinks: int
    place: str
    ours_s: list[float] = Field(default_factory=list)
    cp_s: list[float] = Field(default_factory=list)


class DbDetail(BaseModel):
    db_bytes: int
    wal_bytes: int
    rows: dict[str, int]
    copy_db_s: list[float] = Field(default_factory=list)
    backup_s: list[float] = Field(default_factory=list)
    copy_db_rows_ok: bool = False
    backup_rows_ok: bool = False
    faster: str = ""


class GuardSession(BaseModel):
    fsync_each: bool
    guarded: LatencyStats
    direct: LatencyStats
    stubbed: LatencyStats
    guarded_calls_per_s: float
    direct_calls_per_s: float
    concurrent_clients: int
    guard_handler: LatencyStats | None = None  # the guard's own duration_ms per logged call
    agentworks_bridge: dict[str, Any] = Field(default_factory=dict)  # the step's own check
    calls_logged: int = 0


class GuardDetail(BaseModel):
    design: str
    sessions: list[GuardSession] = Field(default_factory=list)


class ScaleDetail(BaseModel):
    runs: int
    statuses_concurrent: list[str] = Field(default_factory=list)
    statuses_sequential: list[str] = Field(default_factory=list)
    sequential_run_s: list[float] = Field(default_factory=list)
    sequential_wall_s: float = 0.0
    concurrent_wall_s: float = 0.0
    host_used_idle_mb: float = 0.0
    concurrent_peak_mb_per_run: float = 0.0
    sequential_peak_mb_per_run: float = 0.0
    guard_rss_mb: list[float] = Field(default_factory=list)
    upstream_rss_mb: float | None = None
    step_peak_mb: list[float] = Field(default_factory=list)
    sequential_cpu_busy: float = 0.0  # share of all CPUs' time that was busy (host-wide)
    concurrent_cpu_busy: float = 0.0
    sequential_median: PhaseBreakdown | None = None
    concurrent_median: PhaseBreakdown | None = None


class McpDetail(BaseModel):
    server: str
    tool: str
    guarded: LatencyStats | None = None
    direct_call: LatencyStats | None = None
    direct_list: LatencyStats | None = None


class EgressDetail(BaseModel):
    big_bytes: int
    proxied_mb_s: list[float] = Field(default_factory=list)
    direct_mb_s: list[float] = Field(default_factory=list)
    proxied: LatencyStats | None = None
    direct: LatencyStats | None = None


class HostInfo(BaseModel):
    cpus: int
    memory_mb: int
    kernel: str
    python: str
    docker: str
    loadavg_at_start: tuple[float, float, float]
    foreign_containers_at_start: int  # running containers the bench did not make (noise)


class BenchResults(BaseModel):
    schema_version: Literal[1] = 1
    started_at: datetime
    duration_s: float = 0.0
    complete: bool = False  # every benchmark ran with full sizes
    host: HostInfo
    rows: list[Row] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    startup: StartupDetail | None = None
    copy_tree: CopyDetail | None = None
    db_copy: DbDetail | None = None
    guard: GuardDetail | None = None
    scale: ScaleDetail | None = None
    mcp: McpDetail | None = None
    egress: EgressDetail | None = None


# ---------------------------------------------------------------------------------------------
# Sizes. `--quick` shrinks them for developing the bench itself (its results are not written
# to bench/results.json unless --out says so).
# ---------------------------------------------------------------------------------------------


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
    scale_runs: int = 10
    egress_big_mib: int = 100
    egress_small_n: int = 300
    egress_rounds: int = 3
    mcp_n: int = 300
    mcp_rounds: int = 3


QUICK = Sizes(
    startup_n=5,
    copy_mib=40,
    copy_reps=1,
    db_mib=20,
    db_wal_mib=4,
    db_reps=1,
    guard_rounds=1,
    guard_seq_n=200,
    guard_conc_n=100,
    guard_stub_n=100,
    scale_runs=3,
    egress_big_mib=10,
    egress_small_n=100,
    egress_rounds=1,
    mcp_n=50,
    mcp_rounds=1,
)


class BenchError(Exception):
    """A benchmark could not produce its figure (its rows say `failed` and why)."""


# ---------------------------------------------------------------------------------------------
# Scripts run inside containers (stdlib only; the step image has python3).
# ---------------------------------------------------------------------------------------------

# POSTs over keep-alive connections from `procs` forked clients; prints latencies (us).
POST_CLIENT = r"""
import http.client, json, os, sys, time, traceback

cfg = json.loads(sys.argv[1])
BODY = json.dumps(cfg["body"]).encode()
HEADERS = {"Content-Type": "application/json", **cfg["headers"]}
EXPECT = cfg["expect"]


def check(status, data):
    if status != 200:
        raise RuntimeError("HTTP %s: %r" % (status, data[:300]))
    reply = json.loads(data)
    if EXPECT == "result":
        if reply.get("is_error"):
            raise RuntimeError("upstream error: %s" % reply.get("text"))
    elif reply.get("decision") != EXPECT or not reply.get("ok"):
        raise RuntimeError("decision %s: %s" % (reply.get("decision"), reply.get("reason")))


def worker(ready_w, go_r, out_w):
    conn = http.client.HTTPConnection(cfg["host"], cfg["port"], timeout=60)

    def one():
        conn.request("POST", cfg["path"], BODY, HEADERS)
        resp = conn.getresponse()
        check(resp.status, resp.read())

    for _ in range(cfg["warmup"]):
        one()
    os.write(ready_w, b"r")
    os.read(go_r, 1)
    lat = []
    start = time.monotonic()
    for _ in range(cfg["n"]):
        t = time.perf_counter()
        one()
        lat.append(round((time.perf_counter() - t) * 1e6))
    end = time.monotonic()
    with os.fdopen(out_w, "wb") as f:
        f.write(json.dumps({"start": start, "end": end, "lat_us": lat}).encode())


def main():
    procs = cfg["procs"]
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    children = []
    for _ in range(procs):
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(out_r)
                worker(ready_w, go_r, out_w)
            except BaseException:
                traceback.print_exc()
                os.write(ready_w, b"x")
                code = 1
            os._exit(code)
        os.close(out_w)
        children.append((pid, out_r))
    got = b""
    while len(got) < procs:
        got += os.read(ready_r, procs - len(got))
    os.write(go_w, b"g" * procs)
    parts, failed = [], False
    for pid, out_r in children:
        with os.fdopen(out_r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        if status != 0 or not data:
            failed = True
        else:
            parts.append(json.loads(data))
    if failed:
        sys.exit(1)
    lat = [x for p in parts for x in p["lat_us"]]
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    print(json.dumps({"procs": procs, "calls": len(lat), "wall_s": wall, "lat_us": lat}))


main()
"""

# GETs through an HTTP proxy or straight to the server; a new connection per GET (both ways).
GET_CLIENT = r"""
import http.client, json, sys, time
from urllib.parse import urlsplit

cfg = json.loads(sys.argv[1])


def get(url, expect):
    u = urlsplit(url)
    if cfg["proxy"]:
        conn = http.client.HTTPConnection(cfg["proxy"][0], cfg["proxy"][1], timeout=120)
        conn.request("GET", url)
    else:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        conn.request("GET", u.path)
    resp = conn.getresponse()
    n = 0
    while True:
        chunk = resp.read(1 << 20)
        if not chunk:
            break
        n += len(chunk)
    conn.close()
    if resp.status != 200 or n != expect:
        raise SystemExit("GET %s: HTTP %s, %d bytes (expected %d)" % (url, resp.status, n, expect))


for _ in range(cfg["warmup"]):
    get(cfg["small_url"], cfg["small_bytes"])
lat = []
for _ in range(cfg["n"]):
    t = time.perf_counter()
    get(cfg["small_url"], cfg["small_bytes"])
    lat.append(round((time.perf_counter() - t) * 1e6))
t = time.perf_counter()
get(cfg["big_url"], cfg["big_bytes"])
big_s = time.perf_counter() - t
print(json.dumps({"lat_us": lat, "big_s": big_s}))
"""

# MCP through the guard: JSON-RPC over one keep-alive HTTP connection to the guard's endpoint.
MCP_HTTP_CLIENT = r"""
import http.client, json, sys, time

cfg = json.loads(sys.argv[1])
conn = http.client.HTTPConnection("127.0.0.1", cfg["port"], timeout=120)
state = {"sid": None, "id": 0}


def post(message):
    headers = {
        "Authorization": "Bearer " + cfg["token"],
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
    }
    if state["sid"]:
        headers["Mcp-Session-Id"] = state["sid"]
        headers["Mcp-Protocol-Version"] = cfg["version"]
    conn.request("POST", cfg["path"], json.dumps(message).encode(), headers)
    resp = conn.getresponse()
    body = resp.read().decode()
    state["sid"] = resp.getheader("Mcp-Session-Id") or state["sid"]
    if resp.status >= 400:
        raise SystemExit("HTTP %s: %s" % (resp.status, body[:300]))
    if not body.strip():
        return []
    if (resp.getheader("Content-Type") or "").startswith("text/event-stream"):
        return [json.loads(l[5:].strip()) for l in body.splitlines() if l.startswith("data:")]
    parsed = json.loads(body)
    return parsed if isinstance(parsed, list) else [parsed]


def request(method, params):
    state["id"] += 1
    for m in post({"jsonrpc": "2.0", "id": state["id"], "method": method, "params": params}):
        if m.get("id") == state["id"]:
            if "error" in m:
                raise SystemExit("%s: %s" % (method, m["error"]))
            return m["result"]
    raise SystemExit(method + ": no reply")


request("initialize", {"protocolVersion": cfg["version"], "capabilities": {},
                       "clientInfo": {"name": "bench", "version": "1"}})
post({"jsonrpc": "2.0", "method": "notifications/initialized"})


def call():
    result = request("tools/call", {"name": cfg["tool"], "arguments": cfg["arguments"]})
    if result.get("isError") or "TEST MODE" in json.dumps(result):
        raise SystemExit("not a forwarded result: %s" % json.dumps(result)[:300])


for _ in range(cfg["warmup"]):
    call()
lat = []
for _ in range(cfg["n"]):
    t = time.perf_counter()
    call()
    lat.append(round((time.perf_counter() - t) * 1e6))
print(json.dumps({"call_us": lat}))
"""

# The same MCP server spoken to directly over stdio (newline-delimited JSON-RPC), the bytes
# the guard exchanges with it over its socket: the floor for a proxied call, and the
# server's own tools/list time.
MCP_STDIO_CLIENT = r"""
import json, subprocess, sys, time

cfg = json.loads(sys.argv[1])
proc = subprocess.Popen(cfg["command"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL, bufsize=0,
                        env={"PATH": cfg["server_path"], "HOME": "/tmp"})
state = {"id": 0}


def send(message):
    proc.stdin.write((json.dumps(message) + "\n").encode())
    proc.stdin.flush()


def request(method, params):
    state["id"] += 1
    send({"jsonrpc": "2.0", "id": state["id"], "method": method, "params": params})
    while True:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("the server closed its stdout")
        m = json.loads(line)
        if m.get("id") == state["id"]:
            if "error" in m:
                raise SystemExit("%s: %s" % (method, m["error"]))
            return m["result"]


request("initialize", {"protocolVersion": cfg["version"], "capabilities": {},
                       "clientInfo": {"name": "bench", "version": "1"}})
send({"jsonrpc": "2.0", "method": "notifications/initialized"})


def timed(method, params):
    lat = []
    for i in range(cfg["warmup"] + cfg["n"]):
        t = time.perf_counter()
        result = request(method, params)
        if i >= cfg["warmup"]:
            lat.append(round((time.perf_counter() - t) * 1e6))
        if result.get("isError"):
            raise SystemExit("tool error: %s" % json.dumps(result)[:300])
    return lat


out = {"list_us": timed("tools/list", {}),
       "call_us": timed("tools/call", {"name": cfg["tool"], "arguments": cfg["arguments"]})}
proc.stdin.close()
proc.wait(10)
print(json.dumps(out))
"""

# The guard benchmark's step: checks the path a real script takes (agentworks_bridge, a new
# connection per call), says "ready", then holds the run open until the bench releases it.
HOLD_STEP = r"""
import json, os, statistics, sys, time
import agentworks_bridge

lat = []
for i in range(int(sys.argv[1])):
    t = time.perf_counter()
    reply = agentworks_bridge.call(sys.argv[2], {"prompt": "bench-step"})
    lat.append((time.perf_counter() - t) * 1000)
    if reply.get("decision") != "allow" or not reply.get("ok"):
        sys.exit("unexpected reply: %s" % reply)
open("ready", "w").close()
deadline = time.monotonic() + float(sys.argv[3])
while not os.path.exists("release"):
    if time.monotonic() > deadline:
        sys.exit("never released")
    time.sleep(0.02)
lat = sorted(lat[20:]) or [0.0]
print(json.dumps({"n": len(lat), "median_ms": statistics.median(lat),
                  "p90_ms": lat[int(len(lat) * 0.9) - 1]}))
"""

# The scale benchmark's step: a little of everything a real step does through the guard.
SCALE_STEP = r"""
import agentworks_bridge

for i in range(5):
    r = agentworks_bridge.call("generate_text_llm", {"prompt": "scale %d" % i})
    assert r["decision"] == "allow" and r["ok"], r
for i in range(5):
    r = agentworks_bridge.call("notify_user", {"text": "scale %d" % i})
    assert r["decision"] == "stub", r
r = agentworks_bridge.call("query_workflow_db", {"sql": "SELECT count(*) FROM items"})
assert r["decision"] == "redirect" and r["ok"], r
with open("out.txt", "w") as f:
    f.write("done\n")
"""


# ---------------------------------------------------------------------------------------------
# Plumbing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Upstream:
    """The job-board example's fake API (the real bridge's stand-in), run by the bench."""

    network: str
    address: str  # its address on `network`, reachable from the host
    container_id: str

    @property
    def url(self) -> str:
        return f"http://{self.address}:{UPSTREAM_PORT}"


# The job-board example's own server, unchanged, with Nagle's algorithm off on its sockets.
# It writes a reply's headers and body in two send()s; with Nagle on, the body waits for the
# client's delayed ACK of the headers, ~40 ms per call on Linux, which would drown the
# fraction of a millisecond the guard bench measures. (A real bridge replies in one segment.)
UPSTREAM_MAIN = """
import sys
sys.path.insert(0, "/srv")
import server
server.Handler.disable_nagle_algorithm = True
sys.exit(server.main(sys.argv[1:]))
"""


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


def _address_on(b: Bench, container_id: str, network: str) -> str:
    attrs = b.client.api.inspect_container(container_id)
    return str(attrs["NetworkSettings"]["Networks"][network]["IPAddress"])


@contextlib.contextmanager
def upstream_server(b: Bench) -> Iterator[Upstream]:
    """The fake job-board API in a container on a bench network, alias `jobboard`."""
    with bench_network(b) as network:
        container = b.client.containers.create(
            STEP_IMAGE,
            ["python3", "-c", UPSTREAM_MAIN, "--host", "0.0.0.0", "--port", str(UPSTREAM_PORT)],
            user=f"{STEP_UID}:{STEP_UID}",
            labels={BENCH_LABEL: b.bench_id},
            mounts=[DockerMount("/srv/server.py", str(SERVER_PATH), type="bind", read_only=True)],
            network=network,
            networking_config={network: b.client.api.create_endpoint_config(aliases=["jobboard"])},
            detach=True,
        )
        try:
            container.start()
            up = Upstream(network, _address_on(b, str(container.id), network), str(container.id))
            _wait_for("the fake upstream to answer", lambda: _healthy(up.url + "/health"), 30)
            yield up
        finally:
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)


def _healthy(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _wait_for(what: str, probe: Callable[[], Any], deadline_s: float, poll_s: float = 0.02) -> Any:
    """Poll `probe` until it returns something truthy, or fail after `deadline_s`."""
    end = time.monotonic() + deadline_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > end:
            raise BenchError(f"timed out after {deadline_s:g} s waiting for {what}")
        time.sleep(poll_s)


class _Background:
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


def _execute(wf: Path, step: str, options: RunOptions) -> TestRunRecord:
    return TestRun(wf, step, options).execute()


def _write_workflow(
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


def _small_db(path: Path, rows: int = 100) -> None:
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


def _earlier_run(wf: Path, files: int, each_bytes: int) -> None:
    execution = wf / "runs" / "run-1" / "g" / "execution"
    (execution / "notes").mkdir(parents=True)
    for i in range(files):
        (execution / "notes" / f"n{i:03}.txt").write_bytes(os.urandom(each_bytes))


def _tree_bytes(root: Path) -> tuple[int, int]:
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
    ) -> dict[str, Any]:
        """Run `script` with python3 in a container of `image` inside `netns_of`'s network
        namespace (None: no network), as `user`, with the step's default CPU limit; its last
        stdout line is JSON."""
        path = self.work / f"client-{abs(hash(script)) % 10**8}.py"
        if not path.exists():
            path.write_text(script)
            path.chmod(0o644)
        container = self.client.containers.create(
            image,
            ["/bench/client.py", json.dumps(cfg)],
            entrypoint=["python3"],
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


# ---------------------------------------------------------------------------------------------
# Start-up
# ---------------------------------------------------------------------------------------------


def bench_startup(b: Bench) -> list[Row]:
    n = b.sizes.startup_n
    detail = StartupDetail(n=n)
    b.results.startup = detail
    noop = _write_workflow(b.work / "startup-noop", name="noop", step="noop", command=["true"])
    with_db = _write_workflow(b.work / "startup-db", name="withdb", step="noop", command=["true"])
    _small_db(with_db / "db" / "db.sqlite")
    _earlier_run(with_db, files=20, each_bytes=4096)
    server = f'[[mcp_servers]]\nname = "time"\ncommand = {json.dumps(MCP_SERVER)}\n'
    with_mcp = _write_workflow(
        b.work / "startup-mcp", name="withmcp", step="noop", command=["true"], extra_toml=server
    )
    mcp_call = _write_workflow(
        b.work / "startup-mcp-call",
        name="mcpcall",
        step="noop",
        command=["python3", "/workflow/code/call.py"],
        extra_toml=server,
        code={"call.py": STARTUP_MCP_CALL},
    )

    def bare() -> float:
        t = time.perf_counter()
        b.client.containers.run(STEP_IMAGE, ["true"], remove=True, labels={BENCH_LABEL: b.bench_id})
        return time.perf_counter() - t

    def test_run(wf: Path) -> tuple[float, TestRunRecord]:
        t = time.perf_counter()
        record = TestRun(wf, "noop").execute()
        wall = time.perf_counter() - t
        if record.status is not RunStatus.PASSED:
            raise BenchError(f"no-op test run ended {record.status.value}: {record.reason}")
        return wall, record

    b.say("start-up: warm-up (one of each, not counted)")
    bare()
    test_run(noop)
    test_run(with_db)
    test_run(with_mcp)
    test_run(mcp_call)
    runs: list[tuple[float, TestRunRecord]] = []
    db_runs: list[tuple[float, TestRunRecord]] = []
    for i in range(n):  # interleaved, so drift on the machine hits all alike
        b.say(f"start-up: round {i + 1}/{n}")
        detail.bare_s.append(round(bare(), 4))
        runs.append(test_run(noop))
        db_runs.append(test_run(with_db))
        detail.with_mcp_s.append(round(test_run(with_mcp)[0], 4))
        detail.mcp_call_s.append(round(test_run(mcp_call)[0], 4))
    detail.noop_s = [round(w, 4) for w, _ in runs]
    detail.with_db_s = [round(w, 4) for w, _ in db_runs]
    mid = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    detail.noop_median = PhaseBreakdown.of(mid[1], mid[0])
    mid_db = sorted(db_runs, key=lambda r: r[0])[len(db_runs) // 2]
    detail.with_db_median = PhaseBreakdown.of(mid_db[1], mid_db[0])
    bare_med = statistics.median(detail.bare_s)
    b.note(f"start-up, median no-op run: {detail.noop_median.text()}")
    b.note(
        f"start-up, median run with a 100-row DB and a 20-file tree: {detail.with_db_median.text()}"
    )
    return [
        make_row(
            "startup",
            "start-up: no-op step, whole test run",
            "s",
            statistics.median(detail.noop_s),
            bare_med,
            Goal(kind="ratio_max", threshold=2.0, text="<= 2x"),
            baseline_name="docker run --rm",
            note=f"median of {n}",
        ),
        make_row(
            "startup_db",
            "start-up: no-op step + small DB + tree",
            "s",
            statistics.median(detail.with_db_s),
            bare_med,
            baseline_name="docker run --rm",
            note="information: the fixed cost a workflow with a DB pays",
        ),
        make_row(
            "startup_mcp",
            "start-up: no-op step + one stdio MCP server",
            "s",
            statistics.median(detail.with_mcp_s),
            statistics.median(detail.noop_s),
            baseline_name="no-op run without it",
            note="information: the server's own container, started beside the guard",
        ),
        make_row(
            "startup_mcp_call",
            "start-up: step making one MCP call",
            "s",
            statistics.median(detail.mcp_call_s),
            statistics.median(detail.noop_s),
            baseline_name="no-op run without a server",
            note="information: up to the server's first answer, through the guard",
        ),
    ]


# One tools/call to the time server through the guard, then exit.
STARTUP_MCP_CALL = """
import agentworks_mcp
with agentworks_mcp.connect("time") as time_server:
    time_server.call_tool("get_current_time", {"timezone": "UTC"})
"""


# ---------------------------------------------------------------------------------------------
# Copy
# ---------------------------------------------------------------------------------------------


def make_tree(root: Path, total_bytes: int, seed: int = 7) -> CopyDetail:
    """A mixed execution tree of real (random) bytes: many small files in nested folders,
    some medium ones, a few large ones, and a few symlinks."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    written = files = dirs = 0

    def write(path: Path, size: int) -> None:
        nonlocal written, files
        with open(path, "wb") as handle:
            left = size
            while left:
                chunk = min(left, 8 * MIB)
                handle.write(rng.randbytes(chunk))
                left -= chunk
        written += size
        files += 1

    small_budget = total_bytes * 12 // 100
    medium_budget = total_bytes * 33 // 100
    i = 0
    while written < small_budget:
        folder = root / "src" / f"pkg{i % 40:02}" / f"mod{i % 7}"
        if not folder.exists():
            folder.mkdir(parents=True)
        write(folder / f"f{i:05}.txt", rng.randint(512, 32 * 1024))
        i += 1
    (root / "data").mkdir()
    j = 0
    while written < small_budget + medium_budget:
        write(root / "data" / f"m{j:03}.bin", rng.randint(256 * 1024, 3 * MIB))
        j += 1
    (root / "blobs").mkdir()
    rest = total_bytes - written
    for k in range(3):
        write(root / "blobs" / f"large{k}.bin", rest // 3 if k < 2 else rest - 2 * (rest // 3))
    (root / "links").mkdir()
    for k in range(5):
        os.symlink(f"../data/m{k:03}.bin", root / "links" / f"l{k}")
    for _dirpath, dirnames, _ in os.walk(root):
        dirs += len(dirnames)
    os.sync()
    return CopyDetail(
        tree_bytes=written, files=files, dirs=dirs, symlinks=5, place=str(root.parent)
    )


def bench_copy(b: Bench) -> list[Row]:
    s = b.sizes
    src = b.work / "copy-src" / "execution"
    b.say(f"copy: writing a {s.copy_mib} MiB tree")
    detail = make_tree(src, s.copy_mib * MIB)
    b.results.copy_tree = detail

    def ours(dst: Path) -> float:
        dst.mkdir()
        t = time.perf_counter()
        report = copy_execution_tree(src, dst, cap_bytes=512 * MIB)
        elapsed = time.perf_counter() - t
        if (
            report.bytes_copied != detail.tree_bytes
            or report.files_copied != detail.files
            or report.left_out
            or report.errors
            or len(report.symlinks) != detail.symlinks
        ):
            raise BenchError(f"copy_execution_tree dropped something: {report}")
        return elapsed

    def cp(dst: Path) -> float:
        t = time.perf_counter()
        subprocess.run(["cp", "-a", "--", str(src), str(dst)], check=True)
        elapsed = time.perf_counter() - t
        if _tree_bytes(dst) != (detail.tree_bytes, detail.files):
            raise BenchError("cp -a produced a different tree")
        return elapsed

    # Copies are kept until the end: deleting 400 MiB between copies made the next copy up to
    # 2x slower on this machine (ext4 mounted with `discard`), whichever tool made it.
    dests = b.work / "copy-dst"
    dests.mkdir()
    ours(dests / "warm-ours")
    cp(dests / "warm-cp")
    for i in range(s.copy_reps):
        order = ("ours", "cp") if i % 2 == 0 else ("cp", "ours")
        for which in order:
            os.sync()  # the last copy's dirty pages are written before, not during, this one
            if which == "ours":
                elapsed = ours(dests / f"ours-{i}")
                detail.ours_s.append(round(elapsed, 4))
            else:
                elapsed = cp(dests / f"cp-{i}")
                detail.cp_s.append(round(elapsed, 4))
            b.say(f"copy: {which} {elapsed:.2f} s")
    shutil.rmtree(dests)
    mb = detail.tree_bytes / 1e6
    return [
        make_row(
            "copy",
            f"copy: {s.copy_mib} MiB execution tree",
            "MB/s",
            mb / statistics.median(detail.ours_s),
            mb / statistics.median(detail.cp_s),
            Goal(kind="ratio_min", threshold=0.8, text=">= 0.8x cp"),
            baseline_name="cp -a",
            note=(
                f"{detail.files} files, {detail.dirs} dirs; median of {s.copy_reps}; ours"
                f" {min(detail.ours_s):.2f}-{max(detail.ours_s):.2f} s, cp"
                f" {min(detail.cp_s):.2f}-{max(detail.cp_s):.2f} s"
            ),
        )
    ]


# ---------------------------------------------------------------------------------------------
# DB copy
# ---------------------------------------------------------------------------------------------


def make_wal_db(path: Path, main_bytes: int, wal_bytes: int) -> sqlite3.Connection:
    """A WAL database of about main_bytes + wal_bytes whose last wal_bytes of committed rows
    are still only in the WAL. Returns the open connection that keeps them there."""
    rng = random.Random(11)
    con = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=OFF")
    con.executescript(
        """
        CREATE TABLE jobs (id INTEGER PRIMARY KEY, title TEXT NOT NULL, status TEXT,
                           budget INTEGER, body BLOB);
        CREATE TABLE events (id INTEGER PRIMARY KEY, job_id INTEGER, kind TEXT, at REAL);
        CREATE INDEX jobs_title ON jobs (title);
        CREATE INDEX events_job ON events (job_id);
        """
    )
    next_id = 0

    def batch(rows: int) -> None:
        nonlocal next_id
        con.execute("BEGIN")
        jobs: list[tuple[int, str, str, int, bytes]] = []
        events: list[tuple[int, str, float]] = []
        for _ in range(rows):
            next_id += 1
            jobs.append(
                (
                    next_id,
                    f"job {rng.getrandbits(40):x}",
                    rng.choice(("open", "taken", "closed")),
                    rng.randint(50, 5000),
                    rng.randbytes(rng.randint(800, 2400)),
                )
            )
            events.extend((next_id, k, time.time()) for k in ("seen", "scored"))
        con.executemany("INSERT INTO jobs VALUES (?, ?, ?, ?, ?)", jobs)
        con.executemany("INSERT INTO events (job_id, kind, at) VALUES (?, ?, ?)", events)
        con.execute("COMMIT")

    while path.stat().st_size + os.path.getsize(str(path) + "-wal") < main_bytes:
        batch(5000)
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.execute("PRAGMA wal_autocheckpoint=0")  # what follows stays in the WAL
    wal = Path(str(path) + "-wal")
    while wal.stat().st_size < wal_bytes:
        batch(500)
    return con


def _row_counts(path: Path) -> dict[str, int]:
    con = sqlite3.connect(path)
    try:
        return {
            t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("jobs", "events")
        }
    finally:
        con.close()


def bench_db(b: Bench) -> list[Row]:
    s = b.sizes
    folder = b.work / "db"
    folder.mkdir()
    src = folder / "db.sqlite"
    b.say(f"db copy: writing a {s.db_mib} MiB WAL database")
    holder = make_wal_db(src, (s.db_mib - s.db_wal_mib) * MIB, s.db_wal_mib * MIB)
    try:
        expected = {
            t: holder.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("jobs", "events")
        }
        wal_bytes = Path(str(src) + "-wal").stat().st_size
        detail = DbDetail(db_bytes=src.stat().st_size, wal_bytes=wal_bytes, rows=expected)
        b.results.db_copy = detail
        ours_ok = theirs_ok = True
        for i in range(s.db_reps):
            order = ("ours", "backup") if i % 2 == 0 else ("backup", "ours")
            for which in order:
                dst = folder / f"copy-{which}-{i}.sqlite"
                os.sync()
                t = time.perf_counter()
                if which == "ours":
                    copy_db(src, dst)
                else:
                    subprocess.run(["sqlite3", str(src), f".backup '{dst}'"], check=True)
                elapsed = time.perf_counter() - t
                same = _row_counts(dst) == expected
                if which == "ours":
                    detail.copy_db_s.append(round(elapsed, 4))
                    ours_ok &= same
                else:
                    detail.backup_s.append(round(elapsed, 4))
                    theirs_ok &= same
                b.say(f"db copy: {which} {elapsed:.2f} s, rows match: {same}")
                for extra in ("", "-wal", "-shm"):
                    Path(str(dst) + extra).unlink(missing_ok=True)
        detail.copy_db_rows_ok, detail.backup_rows_ok = ours_ok, theirs_ok
    finally:
        holder.close()
    ours = statistics.median(detail.copy_db_s)
    theirs = statistics.median(detail.backup_s)
    detail.faster = "copy_db (VACUUM INTO)" if ours < theirs else "sqlite3 .backup"
    if not (ours_ok and theirs_ok):
        b.note(f"db copy: row counts differ (copy_db ok: {ours_ok}, .backup ok: {theirs_ok})")
    return [
        make_row(
            "db_copy",
            f"db copy: {s.db_mib} MiB DB with {wal_bytes // MIB} MiB WAL",
            "s",
            ours,
            theirs,
            Goal(kind="check", text="same rows; report faster"),
            baseline_name="sqlite3 .backup",
            check=ours_ok and theirs_ok,
            note=f"faster: {detail.faster}",
        )
    ]


# ---------------------------------------------------------------------------------------------
# Guard
# ---------------------------------------------------------------------------------------------

GUARD_DESIGN = (
    "guard: each call is one POST from a stdlib http.client keep-alive loop in a helper "
    "container (step image, 1 CPU like the step) that joins the test run's network namespace "
    "(the guard's). Guarded: as the step's uid to the bridge at 127.0.0.1:{port} "
    "(generate_text_llm, allowed and forwarded). Direct: as the guard's uid (the only one the "
    "firewall lets out) the same tool, with the body and header the guard would send, straight "
    "to the same fake upstream at its container address. Same client code, same namespace, same "
    "upstream; the difference is the guard. Two test runs are held open at once, one with the "
    "action log's fdatasync per line (the default) and one without; blocks alternate between "
    "them and between guarded and direct, {rounds} rounds."
)


def _tagged(cfg: dict[str, Any], tag: str) -> dict[str, Any]:
    """The same call with `prompt` naming its block, so the action log tells blocks apart."""
    body = cfg["body"]
    return {**cfg, "body": {**body, "arguments": {**body["arguments"], "prompt": f"bench-{tag}"}}}


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
    runner = _Background(run.execute)
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
        layout: RunLayout = _wait_for("the held run's step to be ready", ready, 180)
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


@dataclass
class _GuardSamples:
    seq: dict[str, list[int]] = field(default_factory=lambda: {"guarded": [], "direct": []})
    rate: dict[str, list[float]] = field(default_factory=lambda: {"guarded": [], "direct": []})
    stub: list[int] = field(default_factory=list)


def _guard_round(b: Bench, held: Held, fake: Upstream, acc: _GuardSamples, r: int) -> None:
    """One round against one held run: sequential blocks, concurrent blocks, stubbed calls."""
    s = b.sizes
    call = {"tool": "generate_text_llm", "arguments": {"prompt": "bench"}}
    guarded = {
        "host": "127.0.0.1",
        "port": BRIDGE_PORT,
        "path": "/v1/tools/call",
        "headers": {"Authorization": f"Bearer {held.token}"},
        "body": call,
        "expect": "allow",
    }
    stubbed = {
        **guarded,
        "body": {"tool": "notify_user", "arguments": {"text": "bench"}},
        "expect": "stub",
    }
    direct = {
        "host": fake.address,
        "port": UPSTREAM_PORT,
        "path": "/v1/tools/call",
        "headers": {RUN_KIND_HEADER: "test"},
        "body": {
            **call,
            "run_id": held.run_root.name,
            "session": "root",
            "workflow": held.workflow,
            "step": "hold",
            "run_kind": "test",
        },
        "expect": "result",
    }
    targets = {"guarded": (STEP_UID, guarded), "direct": (GUARD_UID, direct)}
    order = ("guarded", "direct") if r % 2 == 0 else ("direct", "guarded")
    for name in order:
        user, cfg = targets[name]
        out = b.helper(
            netns_of=held.guard_id,
            user=user,
            script=POST_CLIENT,
            cfg={**_tagged(cfg, "seq"), "n": s.guard_seq_n, "warmup": 50, "procs": 1},
        )
        acc.seq[name] += out["lat_us"]
    for name in order:
        user, cfg = targets[name]
        out = b.helper(
            netns_of=held.guard_id,
            user=user,
            script=POST_CLIENT,
            cfg={
                **_tagged(cfg, "conc"),
                "n": s.guard_conc_n,
                "warmup": 20,
                "procs": s.guard_conc_procs,
            },
        )
        acc.rate[name].append(out["calls"] / out["wall_s"])
    out = b.helper(
        netns_of=held.guard_id,
        user=STEP_UID,
        script=POST_CLIENT,
        cfg={**stubbed, "n": s.guard_stub_n, "warmup": 20, "procs": 1},
    )
    acc.stub += out["lat_us"]


def _guard_session(b: Bench, held: Held, acc: _GuardSamples, fsync_each: bool) -> GuardSession:
    record = held.record
    if record is None or record.status is not RunStatus.PASSED:
        why = "no record" if record is None else f"{record.status.value}: {record.reason}"
        raise BenchError(f"guard bench run (fsync_each={fsync_each}) did not pass: {why}")
    lines = [
        ActionLine.model_validate_json(raw)
        for raw in (held.run_root / "test_mode_actions.jsonl").read_text().splitlines()
    ]
    # A forwarded call's time in the guard: from its start line to its outcome line.
    bench_calls = {
        line.call_id
        for line in lines
        if line.event == "start"
        and line.tool == "generate_text_llm"
        and line.arguments.get("prompt") == "bench-seq"
    }
    handler_us = [
        (line.duration_ms or 0.0) * 1000
        for line in lines
        if line.event == "outcome" and line.call_id in bench_calls
    ]
    step_check: dict[str, Any] = {}
    with contextlib.suppress(ValueError, IndexError):
        step_check = json.loads(record.stdout.text.strip().splitlines()[-1])
    return GuardSession(
        fsync_each=fsync_each,
        guarded=LatencyStats.from_us(acc.seq["guarded"]),
        direct=LatencyStats.from_us(acc.seq["direct"]),
        stubbed=LatencyStats.from_us(acc.stub),
        guarded_calls_per_s=round(statistics.median(acc.rate["guarded"]), 1),
        direct_calls_per_s=round(statistics.median(acc.rate["direct"]), 1),
        concurrent_clients=b.sizes.guard_conc_procs,
        guard_handler=LatencyStats.from_us(handler_us) if handler_us else None,
        agentworks_bridge=step_check,
        calls_logged=len(lines),
    )


def _hold_workflow(b: Bench, name: str, calls: int, extra_toml: str) -> Path:
    return _write_workflow(
        b.work / name,
        name=name,
        step="hold",
        command=["python3", "/workflow/code/hold.py", str(calls), "generate_text_llm", "400"],
        timeout_s=450,
        extra_toml=extra_toml,
        code={"hold.py": HOLD_STEP},
    )


def bench_guard(b: Bench) -> list[Row]:
    rounds = b.sizes.guard_rounds
    detail = GuardDetail(design=GUARD_DESIGN.format(port=BRIDGE_PORT, rounds=rounds))
    b.results.guard = detail
    with upstream_server(b) as fake:
        options = RunOptions(upstream_networks=(fake.network,))
        no_fsync = RunOptions(upstream_networks=(fake.network,), fsync_action_log=False)
        bridge = f'[bridge]\nupstream = "{fake.url}"\n'
        wf_on = _hold_workflow(b, "guardfsync", 220, bridge)
        wf_off = _hold_workflow(b, "guardnofsync", 220, bridge)
        acc = {True: _GuardSamples(), False: _GuardSamples()}
        b.say("guard: two held test runs, fsync_each on and off")
        with (
            held_run(b, TestRun(wf_on, "hold", options)) as held_on,
            held_run(b, TestRun(wf_off, "hold", no_fsync)) as held_off,
        ):
            for r in range(rounds):
                pair = [(held_on, True), (held_off, False)]
                if r % 2:
                    pair.reverse()
                for held, fsync_each in pair:
                    _guard_round(b, held, fake, acc[fsync_each], r)
                b.say(
                    f"guard: round {r + 1}/{rounds}: guarded median "
                    f"{statistics.median(acc[True].seq['guarded']) / 1000:.2f} ms (fsync), "
                    f"{statistics.median(acc[False].seq['guarded']) / 1000:.2f} ms (no fsync), "
                    f"direct {statistics.median(acc[True].seq['direct']) / 1000:.2f} ms"
                )
        detail.sessions = [
            _guard_session(b, held_on, acc[True], True),
            _guard_session(b, held_off, acc[False], False),
        ]
    on, off = detail.sessions
    b.note(detail.design)
    for sess in detail.sessions:
        handler = sess.guard_handler.median_ms if sess.guard_handler else float("nan")
        b.note(
            f"guard (fsync_each={sess.fsync_each}): guarded median {sess.guarded.median_ms:.3f} ms"
            f" (p99 {sess.guarded.p99_ms:.3f}), direct {sess.direct.median_ms:.3f} ms"
            f" (p99 {sess.direct.p99_ms:.3f}); stubbed call (no upstream)"
            f" {sess.stubbed.median_ms:.3f} ms; the guard's handler time for the sequential"
            f" calls (action log duration_ms: parse, policy, forward incl. the upstream's own"
            f" time, before the log write) {handler:.3f} ms;"
            f" agentworks_bridge from the step (new connection per call):"
            f" {sess.agentworks_bridge.get('median_ms', float('nan')):.3f} ms"
        )
    added = on.guarded.median_ms - on.direct.median_ms
    added_off = off.guarded.median_ms - off.direct.median_ms
    return [
        make_row(
            "guard_latency",
            "guard: allowed call, median latency",
            "ms",
            on.guarded.median_ms,
            on.direct.median_ms,
            Goal(kind="added_max", threshold=1.0, text="< 1 ms added"),
            baseline_name="direct",
            note=f"added {added:.2f} ms; {on.guarded.n} calls each way",
        ),
        make_row(
            "guard_rate",
            f"guard: calls/s, {on.concurrent_clients} clients",
            "calls/s",
            on.guarded_calls_per_s,
            on.direct_calls_per_s,
            Goal(kind="abs_min", threshold=1000, text="> 1,000 calls/s"),
            baseline_name="direct",
        ),
        make_row(
            "guard_latency_nofsync",
            "guard: same, fsync_each off",
            "ms",
            off.guarded.median_ms,
            off.direct.median_ms,
            baseline_name="direct",
            note=f"added {added_off:.2f} ms; information: the cost of fdatasync per log line",
        ),
        make_row(
            "guard_rate_nofsync",
            f"guard: calls/s, {off.concurrent_clients} clients, fsync off",
            "calls/s",
            off.guarded_calls_per_s,
            off.direct_calls_per_s,
            baseline_name="direct",
        ),
    ]


# ---------------------------------------------------------------------------------------------
# Scale
# ---------------------------------------------------------------------------------------------


class _Sampler:
    """Samples host memory in use and our guards' RSS until stopped (a few times a second)."""

    def __init__(self, client: DockerClient, root: Path, period_s: float = 0.2) -> None:
        self.client = client
        self.root = str(root)
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []  # (monotonic, host bytes in use)
        self.guard_rss: dict[str, int] = {}  # container id -> max RSS bytes
        self._procs: dict[str, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    @staticmethod
    def host_used() -> int:
        vm = psutil.virtual_memory()
        return int(vm.total - vm.available)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.host_used()))
            with contextlib.suppress(docker.errors.APIError, psutil.Error, KeyError):
                self._sample_guards()
            self._stop.wait(self.period_s)

    def _sample_guards(self) -> None:
        for item in self.client.api.containers(filters={"label": ["sandbox.role=guard"]}):
            if not item.get("Labels", {}).get("sandbox.run-root", "").startswith(self.root):
                continue
            rss = container_rss(self.client, item["Id"], self._procs)
            if rss is not None:
                self.guard_rss[item["Id"]] = max(self.guard_rss.get(item["Id"], 0), rss)

    def peak_between(self, start: float, end: float) -> int:
        inside = [used for t, used in self.samples if start <= t <= end]
        return max(inside) if inside else 0

    def last_before(self, moment: float) -> int:
        before = [used for t, used in self.samples if t <= moment]
        return before[-1] if before else self.host_used()


def container_rss(client: DockerClient, cid: str, cache: dict[str, psutil.Process]) -> int | None:
    """RSS of every process of a running container (its init and what that started)."""
    proc = cache.get(cid)
    if proc is None:
        pid = int(client.api.inspect_container(cid)["State"]["Pid"] or 0)
        if not pid:
            return None
        proc = cache[cid] = psutil.Process(pid)
    try:
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return None


def _busy_share(before: Any, after: Any) -> float:
    """The share of all CPUs' time between two psutil.cpu_times() that was not idle."""
    total = sum(after) - sum(before)
    idle = (after.idle - before.idle) + (after.iowait - before.iowait)
    return round((total - idle) / total, 3) if total > 0 else 0.0


def _median_phases(records: list[TestRunRecord]) -> PhaseBreakdown:
    """The phases of the run with the median duration (its own wall time, runs overlap)."""
    mid = sorted(records, key=lambda r: r.duration_s or 0.0)[len(records) // 2]
    return PhaseBreakdown.of(mid, mid.duration_s or 0.0)


def bench_scale(b: Bench) -> list[Row]:
    n = b.sizes.scale_runs
    detail = ScaleDetail(runs=n)
    b.results.scale = detail
    root = b.work / "scale"
    flows = []
    for i in range(n):
        wf = _write_workflow(
            root / f"wf{i:02}",
            name=f"scale{i:02}",
            step="work",
            command=["python3", "/workflow/code/work.py"],
            extra_toml='[bridge]\nupstream = "http://jobboard:8080"\n',
            code={"work.py": SCALE_STEP},
        )
        _small_db(wf / "db" / "db.sqlite")
        _earlier_run(wf, files=50, each_bytes=16 * 1024)
        flows.append(wf)
    with upstream_server(b) as fake, _Sampler(b.client, root) as sampler:
        options = RunOptions(upstream_networks=(fake.network,))
        _wait_for("a first memory sample", lambda: len(sampler.samples) >= 3, 10)
        detail.host_used_idle_mb = round(statistics.median(u for _, u in sampler.samples) / 1e6, 1)
        seq_peaks: list[int] = []
        seq_records: list[TestRunRecord] = []
        cpu0 = psutil.cpu_times()
        t_all = time.perf_counter()
        for i, wf in enumerate(flows):
            start = time.monotonic()
            idle = sampler.last_before(start)
            t = time.perf_counter()
            record = TestRun(wf, "work", options).execute()
            detail.sequential_run_s.append(round(time.perf_counter() - t, 3))
            detail.statuses_sequential.append(record.status.value)
            seq_records.append(record)
            seq_peaks.append(sampler.peak_between(start, time.monotonic()) - idle)
            b.say(f"scale: sequential {i + 1}/{n}: {record.status.value}")
        detail.sequential_wall_s = round(time.perf_counter() - t_all, 3)
        detail.sequential_cpu_busy = _busy_share(cpu0, psutil.cpu_times())
        detail.sequential_peak_mb_per_run = round(max(seq_peaks) / 1e6, 1)
        sampler.guard_rss.clear()

        b.say(f"scale: {n} at once")
        start = time.monotonic()
        idle = sampler.last_before(start)
        cpu0 = psutil.cpu_times()
        t_all = time.perf_counter()
        runners = [_Background(functools.partial(_execute, wf, "work", options)) for wf in flows]
        records = [r.join(600) for r in runners]
        detail.concurrent_wall_s = round(time.perf_counter() - t_all, 3)
        detail.concurrent_cpu_busy = _busy_share(cpu0, psutil.cpu_times())
        peak = sampler.peak_between(start, time.monotonic()) - idle
        detail.concurrent_peak_mb_per_run = round(peak / n / 1e6, 1)
        detail.statuses_concurrent = [r.status.value for r in records]
        detail.guard_rss_mb = sorted(round(v / 1e6, 1) for v in sampler.guard_rss.values())
        detail.step_peak_mb = [
            round((r.resources.peak_memory_bytes or 0) / 1e6, 1) for r in records
        ]
        with contextlib.suppress(docker.errors.APIError, psutil.Error):
            up = container_rss(b.client, fake.container_id, {})
            detail.upstream_rss_mb = None if up is None else round(up / 1e6, 1)
    failed = [
        f"{r.step_id}@{Path(r.workflow_dir).name}: {r.status.value} ({r.reason})"
        for r in records
        if r.status is not RunStatus.PASSED
    ]
    all_passed = not failed and all(st == "passed" for st in detail.statuses_sequential)
    if failed:
        b.note("scale: runs that did not pass: " + "; ".join(failed))
    detail.sequential_median = _median_phases(seq_records)
    detail.concurrent_median = _median_phases(records)
    b.note(
        f"scale: host CPU busy {detail.sequential_cpu_busy:.0%} one by one,"
        f" {detail.concurrent_cpu_busy:.0%} with {n} at once (all {os.cpu_count()} CPUs)"
    )
    b.note(f"scale, median run one by one: {detail.sequential_median.text()}")
    b.note(f"scale, median run of {n} at once: {detail.concurrent_median.text()}")
    if len(detail.guard_rss_mb) < n:
        b.note(f"scale: guard RSS sampled for {len(detail.guard_rss_mb)} of {n} guards")
    b.note(
        f"scale: {n} runs at once in {detail.concurrent_wall_s:.1f} s vs"
        f" {detail.sequential_wall_s:.1f} s one after another;"
        f" guard RSS (max per guard, MB): {detail.guard_rss_mb}; step peak"
        f" memory (MB, engine stats): {detail.step_peak_mb}; host memory in use when idle:"
        f" {detail.host_used_idle_mb:.0f} MB"
    )
    return [
        make_row(
            "scale_wall",
            f"scale: {n} runs at once, wall",
            "s",
            detail.concurrent_wall_s,
            detail.sequential_wall_s,
            Goal(kind="check", text=f"all {n} pass"),
            baseline_name="one by one",
            check=all_passed,
            note=f"{sum(st == 'passed' for st in detail.statuses_concurrent)}/{n} passed",
        ),
        make_row(
            "scale_memory",
            "scale: peak host memory per run",
            "MB",
            detail.concurrent_peak_mb_per_run,
            detail.sequential_peak_mb_per_run,
            baseline_name="one by one",
            note="host memory in use (total - available), peak minus idle, per run",
        ),
        make_row(
            "scale_guard_rss",
            "scale: guard RSS, max of the guards",
            "MB",
            max(detail.guard_rss_mb) if detail.guard_rss_mb else None,
            detail.upstream_rss_mb,
            Goal(kind="abs_max", threshold=60, text="< 60 MB"),
            baseline_name="stdlib http.server upstream",
        ),
    ]


# ---------------------------------------------------------------------------------------------
# MCP and egress: measured once their proxies are built
# ---------------------------------------------------------------------------------------------


def feature_built(module: str) -> bool:
    """Whether a guard feature module is real: a placeholder says so in its docstring."""
    mod = importlib.import_module(module)
    return "placeholder" not in (mod.__doc__ or "").lower()


MCP_SERVER = ["mcp-server-time", "--local-timezone", "UTC"]  # installed in the MCP image
MCP_TOOL = ("get_current_time", {"timezone": "UTC"})  # annotated readOnlyHint: forwarded
MCP_VERSION = "2025-06-18"


def bench_mcp(b: Bench) -> list[Row]:
    s = b.sizes
    goal = Goal(kind="added_max", threshold=None, text="<= tools/list + 1 ms added")
    if not feature_built("sandbox.guard.mcp_proxy"):
        why = "sandbox/guard/mcp_proxy.py is a placeholder"
        return [status_row("mcp_latency", "mcp: read-only call", "not built yet", why, goal)]
    detail = McpDetail(server=" ".join(MCP_SERVER), tool=MCP_TOOL[0])
    b.results.mcp = detail
    toml = f'[[mcp_servers]]\nname = "time"\ncommand = {json.dumps(MCP_SERVER)}\n'
    wf = _hold_workflow(b, "mcp", 0, toml)
    guarded_us: list[int] = []
    list_us: list[int] = []
    direct_us: list[int] = []
    with held_run(b, TestRun(wf, "hold")) as held:
        through = {
            "port": BRIDGE_PORT,
            "path": f"{MCP_PATH}/time",
            "token": held.token,
            "version": MCP_VERSION,
            "tool": MCP_TOOL[0],
            "arguments": MCP_TOOL[1],
            "n": s.mcp_n,
            "warmup": 20,
        }
        # The PATH a stdio server gets (the MCP image's servers first).
        server_path = MCP_SERVER_PATH
        direct = {**through, "command": MCP_SERVER, "server_path": server_path}
        for r in range(s.mcp_rounds):
            for which in ("guarded", "direct") if r % 2 == 0 else ("direct", "guarded"):
                if which == "guarded":
                    out = b.helper(
                        netns_of=held.guard_id, user=STEP_UID, script=MCP_HTTP_CLIENT, cfg=through
                    )
                    guarded_us += out["call_us"]
                else:
                    out = b.helper(
                        netns_of=None,
                        user=GUARD_UID,
                        script=MCP_STDIO_CLIENT,
                        cfg=direct,
                        image=MCP_IMAGE,
                    )
                    list_us += out["list_us"]
                    direct_us += out["call_us"]
            b.say(f"mcp: round {r + 1}/{s.mcp_rounds}")
    record = held.record
    if record is None or record.status is not RunStatus.PASSED:
        why = "no record" if record is None else f"{record.status.value}: {record.reason}"
        raise BenchError(f"mcp bench run did not pass: {why}")
    detail.guarded = LatencyStats.from_us(guarded_us)
    detail.direct_call = LatencyStats.from_us(direct_us)
    detail.direct_list = LatencyStats.from_us(list_us)
    floor = detail.direct_list.median_ms + 1.0
    added = detail.guarded.median_ms - detail.direct_call.median_ms
    b.note(
        f"mcp: {detail.tool} of `{detail.server}` (readOnlyHint, so forwarded) through the guard's"
        f" streamable-HTTP endpoint from the run's namespace as the step's uid, one keep-alive"
        f" connection, vs the same server spoken to over stdio directly in an MCP-image"
        f" container (the guard reaches it over its relay's socket); its own tools/list takes"
        f" {detail.direct_list.median_ms:.2f} ms (median), so the goal allows"
        f" {floor:.2f} ms added"
    )
    return [
        make_row(
            "mcp_latency",
            "mcp: read-only call, median",
            "ms",
            detail.guarded.median_ms,
            detail.direct_call.median_ms,
            goal.model_copy(update={"threshold": floor}),
            baseline_name="direct stdio",
            note=f"added {added:.2f} ms; allowed {floor:.2f} ms",
        )
    ]


def bench_egress(b: Bench) -> list[Row]:
    s = b.sizes
    thr_goal = Goal(kind="ratio_min", threshold=0.8, text=">= 0.8x direct")
    lat_goal = Goal(kind="added_max", threshold=1.0, text="< 1 ms added")
    if not feature_built("sandbox.guard.egress"):
        why = "sandbox/guard/egress.py is a placeholder"
        return [
            status_row("egress_rate", "egress: 100 MB GET", "not built yet", why, thr_goal),
            status_row(
                "egress_latency", "egress: small GET, median", "not built yet", why, lat_goal
            ),
        ]
    files = b.work / "egress-files"
    files.mkdir()
    files.chmod(0o755)
    big = s.egress_big_mib * MIB
    with open(files / "big.bin", "wb") as handle:
        for _ in range(s.egress_big_mib):
            handle.write(os.urandom(MIB))
    (files / "small.txt").write_bytes(b"x" * 1024)
    for f in files.iterdir():
        f.chmod(0o644)
    detail = EgressDetail(big_bytes=big)
    b.results.egress = detail
    with bench_network(b) as network:
        server = b.client.containers.run(
            STEP_IMAGE,
            ["python3", "-m", "http.server", "8081", "--bind", "0.0.0.0", "--directory", "/srv"],
            user=f"{STEP_UID}:{STEP_UID}",
            network=network,
            mounts=[DockerMount("/srv", str(files), type="bind", read_only=True)],
            labels={BENCH_LABEL: b.bench_id},
            detach=True,
        )
        try:
            server.reload()
            address = _address_on(b, str(server.id), network)
            small_url = f"http://{address}:8081/small.txt"
            _wait_for("the egress bench's file server", lambda: _healthy(small_url), 30)
            wf = _hold_workflow(b, "egress", 0, f'[egress]\nallow = ["{address}:8081"]\n')
            run = TestRun(wf, "hold", RunOptions(upstream_networks=(network,)))
            lat: dict[str, list[int]] = {"proxied": [], "direct": []}
            with held_run(b, run) as held:
                base = {
                    "small_url": small_url,
                    "small_bytes": 1024,
                    "big_url": f"http://{address}:8081/big.bin",
                    "big_bytes": big,
                    "n": s.egress_small_n,
                    "warmup": 20,
                }
                targets = {
                    "proxied": (STEP_UID, {**base, "proxy": ["127.0.0.1", EGRESS_PORT]}),
                    "direct": (GUARD_UID, {**base, "proxy": None}),
                }
                for r in range(s.egress_rounds):
                    order = ("proxied", "direct") if r % 2 == 0 else ("direct", "proxied")
                    for name in order:
                        user, cfg = targets[name]
                        out = b.helper(
                            netns_of=held.guard_id, user=user, script=GET_CLIENT, cfg=cfg
                        )
                        lat[name] += out["lat_us"]
                        mb_s = round(big / 1e6 / out["big_s"], 1)
                        (detail.proxied_mb_s if name == "proxied" else detail.direct_mb_s).append(
                            mb_s
                        )
                    b.say(f"egress: round {r + 1}/{s.egress_rounds}")
        finally:
            with contextlib.suppress(docker.errors.NotFound):
                server.remove(force=True)
    record = held.record
    if record is None or record.status is not RunStatus.PASSED:
        why = "no record" if record is None else f"{record.status.value}: {record.reason}"
        raise BenchError(f"egress bench run did not pass: {why}")
    detail.proxied = LatencyStats.from_us(lat["proxied"])
    detail.direct = LatencyStats.from_us(lat["direct"])
    b.note(
        "egress: a helper in the run's network namespace GETs from a plain http.server container"
        " through the guard's proxy as the step's uid, and directly as the guard's uid; a new"
        " connection per GET both ways."
    )
    return [
        make_row(
            "egress_rate",
            f"egress: {s.egress_big_mib} MiB GET",
            "MB/s",
            statistics.median(detail.proxied_mb_s),
            statistics.median(detail.direct_mb_s),
            thr_goal,
            baseline_name="direct",
        ),
        make_row(
            "egress_latency",
            "egress: small GET, median",
            "ms",
            detail.proxied.median_ms,
            detail.direct.median_ms,
            lat_goal,
            baseline_name="direct",
            note=f"added {detail.proxied.median_ms - detail.direct.median_ms:.2f} ms",
        ),
    ]


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

from bench.chain import bench_chain  # noqa: E402  (it reads this module's helpers)

BENCHMARKS: dict[str, tuple[str, Callable[[Bench], list[Row]]]] = {
    "startup": ("start-up", bench_startup),
    "copy": ("copy", bench_copy),
    "db": ("db copy", bench_db),
    "guard": ("guard", bench_guard),
    "scale": ("scale", bench_scale),
    "mcp": ("mcp", bench_mcp),
    "egress": ("egress", bench_egress),
    "chain": ("whole-workflow chain", bench_chain),
}


def host_info(client: DockerClient) -> HostInfo:
    version = str(client.version().get("Version", "?"))
    load = os.getloadavg()
    return HostInfo(
        cpus=os.cpu_count() or 0,
        memory_mb=psutil.virtual_memory().total // MIB,
        kernel=platform.release(),
        python=platform.python_version(),
        docker=version,
        loadavg_at_start=(round(load[0], 2), round(load[1], 2), round(load[2], 2)),
        foreign_containers_at_start=len(client.api.containers()),
    )


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A private scratch folder on the same file system as the runs' default place."""
    base = Path("/var/tmp") if Path("/var/tmp").is_dir() else Path(tempfile.gettempdir())
    path = Path(tempfile.mkdtemp(prefix="sandbox-bench-", dir=base))
    path.chmod(0o755)  # the step and guard uids read workflow files below it
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run(selected: list[str], sizes: Sizes) -> BenchResults:
    client = connect()
    results = BenchResults(started_at=datetime.now(UTC), host=host_info(client))
    started = time.monotonic()
    with scratch_dir() as work:
        bench = Bench(client, work, sizes, results)
        try:
            for key in selected:
                title, func = BENCHMARKS[key]
                bench.say(f"== {title}")
                try:
                    results.rows += func(bench)
                except Exception as exc:
                    traceback.print_exc(file=sys.stderr)
                    results.rows.append(
                        status_row(key, f"{title}: benchmark", "failed", f"{exc}"[:300])
                    )
                finally:
                    bench.cleanup()
        finally:
            bench.cleanup()
    results.duration_s = round(time.monotonic() - started, 1)
    host = results.host
    if host.foreign_containers_at_start or host.loadavg_at_start[0] > host.cpus / 2:
        results.notes.append(
            f"host was busy at start (load average {host.loadavg_at_start[0]:.1f} on"
            f" {host.cpus} CPUs, {host.foreign_containers_at_start} containers of others"
            " running): absolute figures are noisier than on an idle machine; ratios are"
            " measured interleaved to cancel most of it"
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sandbox bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default="", help=f"comma-separated subset of: {','.join(ALL_BENCHMARKS)}"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (developing the bench)")
    parser.add_argument(
        "--out", default=None, help=f"results JSON (default {RESULTS_PATH} for a full run)"
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print the table of the results file as markdown"
    )
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else RESULTS_PATH
    if args.markdown:
        saved = BenchResults.model_validate_json(out.read_text())
        print(format_table(saved.rows, markdown=True))
        return 0
    selected = [s.strip() for s in args.only.split(",") if s.strip()] or list(ALL_BENCHMARKS)
    unknown = [s for s in selected if s not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    sizes = QUICK if args.quick else Sizes()
    results = run(selected, sizes)
    results.complete = not args.quick and selected == list(ALL_BENCHMARKS)
    print(format_table(results.rows))
    print()
    for row in results.rows:
        if row.note:
            print(f"- {row.figure}: {row.note}")
    for note in results.notes:
        print(f"- {note}")
    print(f"\ntotal {results.duration_s:.0f} s on {results.host.cpus} CPUs")
    if results.complete or args.out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(results.model_dump_json(indent=2) + "\n")
        print(f"results: {out}")
    return 1 if any(r.status == "failed" for r in results.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
