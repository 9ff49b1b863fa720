"""Egress: GETs through the guard's proxy vs straight to the server, from the run's
network namespace."""

from __future__ import annotations

import contextlib
import os
import statistics

import docker.errors
from docker.types import Mount as DockerMount

from bench.common import (
    BENCH_LABEL,
    GET_CLIENT,
    MIB,
    Bench,
    BenchError,
    address_on,
    bench_network,
    healthy,
    held_run,
    hold_workflow,
    wait_for,
)
from bench.results import EgressDetail, Goal, LatencyStats, Row, make_row
from sandbox.contracts.layout import GUARD_UID, STEP_UID
from sandbox.contracts.names import STEP_IMAGE
from sandbox.contracts.record import RunStatus
from sandbox.guard.config import EGRESS_PORT
from sandbox.run.testrun import RunOptions, TestRun


def bench_egress(b: Bench) -> list[Row]:
    s = b.sizes
    thr_goal = Goal(kind="ratio_min", threshold=0.8, text=">= 0.8x direct")
    lat_goal = Goal(kind="added_max", threshold=1.0, text="< 1 ms added")
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
            address = address_on(b, str(server.id), network)
            small_url = f"http://{address}:8081/small.txt"
            wait_for("the egress bench's file server", lambda: healthy(small_url), 30)
            wf = hold_workflow(b, "egress", 0, f'[egress]\nallow = ["{address}:8081"]\n')
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
