"""Guard: an allowed bridge call through the guard vs the same call sent straight to
the upstream, both from the guard's network namespace."""

from __future__ import annotations

import contextlib
import json
import statistics
from dataclasses import dataclass, field
from typing import Any

from bench.common import (
    POST_CLIENT,
    SYNC_LINE_BYTES,
    UPSTREAM_PORT,
    Bench,
    BenchError,
    Held,
    Upstream,
    held_run,
    hold_workflow,
    log_sync_alone,
    upstream_server,
)
from bench.results import Goal, GuardDetail, GuardSession, LatencyStats, Row, make_row
from sandbox.contracts.guardconfig import BRIDGE_PORT
from sandbox.contracts.layout import GUARD_UID, STEP_UID
from sandbox.contracts.record import RunStatus
from sandbox.contracts.wire import RUN_KIND_HEADER, ActionLine
from sandbox.run.testrun import RunOptions, TestRun

GUARD_DESIGN = (
    "guard: each call is one POST from a stdlib http.client keep-alive loop in a helper "
    "container (step image, 1 CPU like the step) that joins the test run's network namespace "
    "(the guard's). Guarded: as the step's uid to the bridge at 127.0.0.1:{port} "
    "(generate_text_llm, allowed and forwarded). Direct: as the guard's uid (the only one the "
    "firewall lets out) the same tool, with the body and header the guard would send, straight "
    "to the same fake upstream at its container address. Same client code, same namespace, same "
    "upstream; the difference is the guard. Two test runs are held open at once, one with the "
    "action log in group commit (the default: each line written before its call goes on, "
    "synced off the request path) and one with durability per-call (each line synced before "
    "its call goes on); blocks alternate between them and between guarded and direct, "
    "{rounds} rounds."
)


def _tagged(cfg: dict[str, Any], tag: str) -> dict[str, Any]:
    """The same call with `prompt` naming its block, so the action log tells blocks apart."""
    body = cfg["body"]
    return {**cfg, "body": {**body, "arguments": {**body["arguments"], "prompt": f"bench-{tag}"}}}


@dataclass
class _GuardSamples:
    seq: dict[str, list[int]] = field(default_factory=lambda: {"guarded": [], "direct": []})
    rate: dict[str, list[float]] = field(default_factory=lambda: {"guarded": [], "direct": []})
    conc: dict[str, list[int]] = field(default_factory=lambda: {"guarded": [], "direct": []})
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
        acc.conc[name] += out["lat_us"]
    out = b.helper(
        netns_of=held.guard_id,
        user=STEP_UID,
        script=POST_CLIENT,
        cfg={**stubbed, "n": s.guard_stub_n, "warmup": 20, "procs": 1},
    )
    acc.stub += out["lat_us"]


def _guard_session(b: Bench, held: Held, acc: _GuardSamples, durability: str) -> GuardSession:
    record = held.record
    if record is None or record.status is not RunStatus.PASSED:
        why = "no record" if record is None else f"{record.status.value}: {record.reason}"
        raise BenchError(f"guard bench run (durability {durability}) did not pass: {why}")
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
        durability=durability,
        guarded=LatencyStats.from_us(acc.seq["guarded"]),
        direct=LatencyStats.from_us(acc.seq["direct"]),
        stubbed=LatencyStats.from_us(acc.stub),
        guarded_calls_per_s=round(statistics.median(acc.rate["guarded"]), 1),
        direct_calls_per_s=round(statistics.median(acc.rate["direct"]), 1),
        concurrent_clients=b.sizes.guard_conc_procs,
        concurrent=LatencyStats.from_us(acc.conc["guarded"]),
        concurrent_direct=LatencyStats.from_us(acc.conc["direct"]),
        guard_handler=LatencyStats.from_us(handler_us) if handler_us else None,
        agentworks_bridge=step_check,
        calls_logged=len(lines),
    )


def bench_guard(b: Bench) -> list[Row]:
    rounds = b.sizes.guard_rounds
    detail = GuardDetail(design=GUARD_DESIGN.format(port=BRIDGE_PORT, rounds=rounds))
    b.results.guard = detail
    with upstream_server(b) as fake:
        group = RunOptions(upstream_networks=(fake.network,), durability="group")
        per_call = RunOptions(upstream_networks=(fake.network,), durability="per-call")
        bridge = f'[bridge]\nupstream = "{fake.url}"\n'
        wf_group = hold_workflow(b, "guardgroup", 220, bridge)
        wf_per_call = hold_workflow(b, "guardpercall", 220, bridge)
        acc = {"group": _GuardSamples(), "per-call": _GuardSamples()}
        sync_us: list[int] = []
        b.say("guard: two held test runs, durability group and per-call")
        with (
            held_run(b, TestRun(wf_group, "hold", group)) as held_group,
            held_run(b, TestRun(wf_per_call, "hold", per_call)) as held_per_call,
        ):
            for r in range(rounds):
                pair = [(held_group, "group"), (held_per_call, "per-call")]
                if r % 2:
                    pair.reverse()
                for held, durability in pair:
                    _guard_round(b, held, fake, acc[durability], r)
                where = held_group.run_root.parent
                sync_us += log_sync_alone(where, b.sizes.guard_sync_n)
                b.say(
                    f"guard: round {r + 1}/{rounds}: guarded median "
                    f"{statistics.median(acc['group'].seq['guarded']) / 1000:.2f} ms (group), "
                    f"{statistics.median(acc['per-call'].seq['guarded']) / 1000:.2f} ms "
                    f"(per-call), direct {statistics.median(acc['group'].seq['direct']) / 1000:.2f}"
                    " ms"
                )
        detail.sessions = [
            _guard_session(b, held_group, acc["group"], "group"),
            _guard_session(b, held_per_call, acc["per-call"], "per-call"),
        ]
    on, off = detail.sessions
    b.note(detail.design)
    for sess in detail.sessions:
        handler = sess.guard_handler.median_ms if sess.guard_handler else float("nan")
        b.note(
            f"guard (durability {sess.durability}): guarded median {sess.guarded.median_ms:.3f} ms"
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
    sync = LatencyStats.from_us(sync_us)
    detail.log_sync_alone = sync
    floor = off.direct.median_ms + sync.median_ms
    assert on.concurrent is not None and on.concurrent_direct is not None
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
            "guard_stub",
            "bridge: stubbed call (answered in the guard), median",
            "ms",
            on.stubbed.median_ms,
            on.direct.median_ms,
            baseline_name="direct forwarded call",
            note=f"p99 {on.stubbed.p99_ms:.2f} ms; {on.stubbed.n} calls; the same client and"
            " namespace; the floor is the same call straight to a lean upstream (no policy,"
            " no log): what the guard adds to a call it answers itself",
        ),
        make_row(
            "guard_rate",
            f"guard: calls/s, {on.concurrent_clients} clients",
            "calls/s",
            on.guarded_calls_per_s,
            on.direct_calls_per_s,
            # issue 33: quiet, and beside the hogs (`--load`)
            Goal(kind="abs_min", threshold=2000, text="> 2,000 calls/s")
            if b.results.load
            else Goal(kind="abs_min", threshold=3000, text="> 3,000 calls/s"),
            baseline_name="direct",
        ),
        make_row(
            "guard_p99",
            f"guard: allowed call, {on.concurrent_clients} clients, p99",
            "ms",
            on.concurrent.p99_ms,
            on.concurrent_direct.p99_ms,
            Goal(kind="abs_max", threshold=3.0, text="< 3 ms"),
            baseline_name="direct",
            note=f"median {on.concurrent.median_ms:.2f} ms vs {on.concurrent_direct.median_ms:.2f}",
        ),
        make_row(
            "guard_log_sync",
            "guard: the log's write + fdatasync alone, same disk",
            "ms",
            sync.median_ms,
            None,
            note=f"p99 {sync.p99_ms:.2f} ms; {sync.n} samples of one {SYNC_LINE_BYTES}-byte line",
        ),
        make_row(
            "guard_vs_sync_floor",
            "guard: allowed call, durability per-call, vs direct + its log sync",
            "ms",
            off.guarded.median_ms,
            floor,
            baseline_name="direct + 1 sync",
            note="per-call, a forwarded call's reply waits for one sync (its outcome line's,"
            " which covers its start line, written before it was forwarded); what is left above"
            f" this floor is the guard's own work: {off.guarded.median_ms - floor:.2f} ms",
        ),
        make_row(
            "guard_rate_sync_ceiling",
            f"guard: calls/s, {off.concurrent_clients} clients, per-call, vs one sync per call",
            "calls/s",
            off.guarded_calls_per_s,
            off.concurrent_clients * 1000 / sync.mean_ms if sync.mean_ms else None,
            baseline_name="clients / sync",
            note="the most durability per-call lets these clients reach on this disk: each client"
            " sends its next call after its reply, and a reply waits for a sync that began after"
            " its line was written (group commit shares that sync among concurrent calls, but"
            f" none waits less than one), so {off.concurrent_clients} clients make at most"
            f" {off.concurrent_clients} calls per mean sync time ({sync.mean_ms:.2f} ms)",
        ),
        make_row(
            "guard_latency_percall",
            "guard: same, durability per-call",
            "ms",
            off.guarded.median_ms,
            off.direct.median_ms,
            baseline_name="direct",
            note=f"added {added_off:.2f} ms; information: the cost of a sync per call",
        ),
        make_row(
            "guard_rate_percall",
            f"guard: calls/s, {off.concurrent_clients} clients, per-call",
            "calls/s",
            off.guarded_calls_per_s,
            off.direct_calls_per_s,
            baseline_name="direct",
        ),
    ]
