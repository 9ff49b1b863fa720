"""Egress: GETs through the guard's proxy vs straight to the server, from the run's
network namespace."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path, PurePosixPath

import docker.errors
from docker.types import Mount as DockerMount

from bench import peers
from bench.common import (
    BENCH_LABEL,
    DNS_CLIENT,
    GET_CLIENT,
    MIB,
    Bench,
    BenchError,
    address_on,
    bench_network,
    healthy,
    held_run,
    hold_workflow,
    log_sync_alone,
    program,
    wait_for,
)
from bench.results import EgressDetail, Goal, LatencyStats, Row, make_row, paired_ratio
from sandbox.contracts.guardconfig import EGRESS_PORT
from sandbox.contracts.layout import GUARD_UID, STEP_UID
from sandbox.contracts.names import STEP_IMAGE
from sandbox.contracts.record import RunStatus
from sandbox.run.testrun import RunOptions, TestRun

# "transparent": the step's uid GETs the server's address itself, no proxy; the firewall
# redirects the connection to the guard's interception port.
TARGETS = ("guard", "transparent", "direct", "squid", "tinyproxy")
MODES = ("new", "keep")  # a new connection per GET; one kept-alive connection for all
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Big GETs per target and round, each timed: one ~0.1 s transfer is too short a sample on
# a shared 2-CPU host (one helper's samples spread up to 1.7x), so each round takes several.
BIG_REPEATS = 3
# The 100 MiB goal's two arms, measured in adjacent helpers (see `paired_ratio`), with
# this many GETs each: two pairs per round, four GETs each way.
PAIRED = ("guard", "direct")
PAIRED_REPEATS = 2
SMALL_WARMUP = 20  # untimed small GETs before each helper's timed ones
# The floor rows' syncs are this far apart, as the guard's are (one per request, a
# small GET taking about a millisecond): here a sync 1 ms after the last took 250 us
# at the median where back-to-back ones took 200 (the disk and the CPUs go idle).
SYNC_GAP_S = 0.001


def cpu_ns(b: Bench, container_id: str) -> int | None:
    """CPU time the container's cgroup has used so far, in ns (cgroup v1
    `cpuacct.usage`, v2 `cpu.stat` usage_usec), read on the host; None when the
    engine's cgroups are not visible here."""
    pid = b.client.api.inspect_container(container_id)["State"]["Pid"]
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path.startswith("/") or ".." in PurePosixPath(path).parts:
            continue
        try:
            if "cpuacct" in controllers.split(","):
                usage = (CGROUP_ROOT / "cpuacct" / path.lstrip("/") / "cpuacct.usage").read_text()
                return int(usage)
            if hierarchy == "0" and controllers == "":
                stat = (CGROUP_ROOT / path.lstrip("/") / "cpu.stat").read_text()
                fields = dict(ln.split() for ln in stat.splitlines() if ln.count(" ") == 1)
                return int(fields["usage_usec"]) * 1000
        except (OSError, KeyError, ValueError):
            return None
    return None


def per_get_ms(before_ns: int | None, after_ns: int | None, gets: int) -> float | None:
    """A proxy's CPU per GET from its cgroup's count before and after `gets` GETs (ms);
    None when either count is missing (cgroups not visible) or there was no GET."""
    if before_ns is None or after_ns is None or gets <= 0:
        return None
    return round((after_ns - before_ns) / 1e6 / gets, 4)


QUIET_NS = 2_000_000  # at most this much CPU in QUIET_WINDOW_S: the container is idle
QUIET_WINDOW_S = 0.2


def wait_quiet(b: Bench, container_id: str, timeout_s: float = 15) -> None:
    """Return once the container's cgroup has used at most QUIET_NS of CPU over the last
    QUIET_WINDOW_S (or after `timeout_s`, or at once when its cgroup is not visible).

    The held run's step says ready once the guard's ports listen, while the guard is
    still loading its web stack (some 130 ms of CPU over the next 0.3 s here): the
    first helper, through whichever target comes first (the guard, in a one-round
    run), would share the CPUs with it, and the guard's count for its GETs would
    include it."""
    deadline = time.monotonic() + timeout_s
    last = cpu_ns(b, container_id)
    while last is not None and time.monotonic() < deadline:
        time.sleep(QUIET_WINDOW_S)
        now = cpu_ns(b, container_id)
        if now is None or now - last <= QUIET_NS:
            return
        last = now


def _container_at(b: Bench, network: str, address: str) -> str:
    """The id of the bench's container that has `address` on `network`."""
    for item in b.client.api.containers(filters={"label": [f"{BENCH_LABEL}={b.bench_id}"]}):
        if address_on(b, item["Id"], network) == address:
            return str(item["Id"])
    raise BenchError(f"no bench container has {address} on {network}")


def bench_egress(b: Bench) -> list[Row]:
    s = b.sizes
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
    server_program = b.work / "file_server.py"  # where the server's uid can read it
    server_program.write_text(program("file_server.py"))
    server_program.chmod(0o644)
    detail = EgressDetail(big_bytes=big)
    b.results.egress = detail
    lat: dict[str, list[int]] = {}
    mb_s: dict[str, list[float]] = {}
    cpu_ms: dict[str, list[float]] = {}
    # "guard/keep", "squid/new", ...: the proxy's CPU per small GET, each helper's GETs
    # (its warm-up ones too: they go through the proxy as well) over its cgroup's count
    small_cpu_ms: dict[str, list[float]] = {}
    sync_us: list[int] = []
    dns_lat: dict[str, list[int]] = {}  # "guard", "engine": one A query's answer, us
    # (guard, direct): the medians of two adjacent helpers' 100 MiB GETs, MB/s
    pairs: list[tuple[float, float]] = []
    with bench_network(b) as network:
        # HTTP/1.1 with keep-alive, so that every proxy may keep its connection to it
        server = b.client.containers.run(
            STEP_IMAGE,
            ["python3", "/bench/file_server.py", "8081", "/srv"],
            user=f"{STEP_UID}:{STEP_UID}",
            network=network,
            mounts=[
                DockerMount("/srv", str(files), type="bind", read_only=True),
                DockerMount(
                    "/bench/file_server.py",
                    str(server_program),
                    type="bind",
                    read_only=True,
                ),
            ],
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
            with peers.running(b, network, small_url) as peer_at, held_run(b, run) as held:
                base = {
                    "small_url": small_url,
                    "small_bytes": 1024,
                    "big_bytes": big,
                    "n": s.egress_small_n,
                    "warmup": SMALL_WARMUP,
                }
                proxies: dict[str, tuple[int, list[object] | None]] = {
                    "guard": (STEP_UID, ["127.0.0.1", EGRESS_PORT]),
                    "transparent": (STEP_UID, None),
                    "direct": (GUARD_UID, None),
                    **{name: (GUARD_UID, [a, port]) for name, (a, port) in peer_at.items()},
                }
                # whose CPU a big GET through each proxy is counted in
                counted = {
                    "guard": held.guard_id,
                    "transparent": held.guard_id,
                    **{name: _container_at(b, network, a) for name, (a, _) in peer_at.items()},
                }
                for container_id in counted.values():
                    wait_quiet(b, container_id)
                guard_name = str(b.client.containers.get(held.guard_id).name)

                def big_gets(name: str, repeats: int) -> list[float]:
                    """`repeats` big GETs through `name` alone in a helper, so the proxy's
                    cgroup counts only them; their rates, MB/s."""
                    user, proxy = proxies[name]
                    big_cfg = {
                        **base,
                        "proxy": proxy,
                        "n": 0,
                        "warmup": 0,
                        "big_url": f"http://{address}:8081/big.bin",
                        "big_n": repeats,
                    }
                    before = cpu_ns(b, counted[name]) if name in counted else None
                    out = b.helper(
                        netns_of=held.guard_id, user=user, script=GET_CLIENT, cfg=big_cfg
                    )
                    after = cpu_ns(b, counted[name]) if name in counted else None
                    rates = [round(big / 1e6 / t, 1) for t in out["big_s"]]
                    mb_s.setdefault(name, []).extend(rates)
                    if before is not None and after is not None:
                        per_get = (after - before) / 1e6 / len(out["big_s"])
                        cpu_ms.setdefault(name, []).append(round(per_get, 1))
                    return rates

                for r in range(s.egress_rounds):
                    order = TARGETS[r % len(TARGETS) :] + TARGETS[: r % len(TARGETS)]
                    for name in order:
                        user, proxy = proxies[name]
                        for mode in MODES if name != "tinyproxy" else ("new",):
                            cfg = {**base, "proxy": proxy, "keepalive": mode == "keep"}
                            before = cpu_ns(b, counted[name]) if name in counted else None
                            out = b.helper(
                                netns_of=held.guard_id, user=user, script=GET_CLIENT, cfg=cfg
                            )
                            after = cpu_ns(b, counted[name]) if name in counted else None
                            lat.setdefault(f"{name}/{mode}", []).extend(out["lat_us"])
                            gets = len(out["lat_us"]) + SMALL_WARMUP
                            if (per_get := per_get_ms(before, after, gets)) is not None:
                                small_cpu_ms.setdefault(f"{name}/{mode}", []).append(per_get)
                        if name not in PAIRED:
                            big_gets(name, BIG_REPEATS)
                    # the guard's and direct's big GETs side by side, A B B A (B A A B
                    # in the next round): each pair's two helpers run one right after
                    # the other, so the host moves both alike
                    first, second = PAIRED if r % 2 == 0 else PAIRED[::-1]
                    block: dict[str, list[float]] = {}
                    for name in (first, second, second, first):
                        block.setdefault(name, []).append(
                            statistics.median(big_gets(name, PAIRED_REPEATS))
                        )
                    for guard_rate, direct_rate in zip(
                        block["guard"], block["direct"], strict=True
                    ):
                        pairs.append((guard_rate, direct_rate))
                    sync_us += log_sync_alone(
                        held.run_root.parent, b.sizes.guard_sync_n, SYNC_GAP_S
                    )
                    for who, user, name in (
                        ("guard", STEP_UID, "bench-lookup.example"),
                        # the guard's own name: one the engine answers without forwarding
                        ("engine", GUARD_UID, guard_name),
                    ):
                        dns_cfg = {"name": name, "n": s.egress_small_n, "warmup": SMALL_WARMUP}
                        out = b.helper(
                            netns_of=held.guard_id, user=user, script=DNS_CLIENT, cfg=dns_cfg
                        )
                        dns_lat.setdefault(who, []).extend(out["lat_us"])
                    b.say(f"egress: round {r + 1}/{s.egress_rounds}")
        finally:
            with contextlib.suppress(docker.errors.NotFound):
                server.remove(force=True)
    record = held.record
    if record is None or record.status is not RunStatus.PASSED:
        why = "no record" if record is None else f"{record.status.value}: {record.reason}"
        raise BenchError(f"egress bench run did not pass: {why}")
    detail.small = {key: LatencyStats.from_us(samples) for key, samples in lat.items()}
    detail.mb_s = mb_s
    detail.dns = {key: LatencyStats.from_us(samples) for key, samples in dns_lat.items()}
    detail.big_cpu_ms = cpu_ms
    detail.small_cpu_ms = small_cpu_ms
    sync_alone = detail.log_sync_alone = LatencyStats.from_us(sync_us)
    sync_ms = sync_alone.median_ms
    b.note(
        "egress: a helper in the run's network namespace GETs a 1 KiB file from an HTTP/1.1"
        " keep-alive http.server container (Nagle off) through the guard's proxy as the"
        " step's uid, directly as the guard's uid, and through Squid and tinyproxy"
        " (Debian's, each in its own container on the same network, 1 CPU, caching off,"
        " access log on; neither syncs its log) as the guard's uid: a new connection per"
        " GET, then one kept-alive connection for all (not through tinyproxy: it closes the"
        " client's connection after every reply, without saying so); and"
        f" {s.egress_big_mib} MiB GETs, each timed, each on a new connection: {BIG_REPEATS}"
        " per round through Squid, tinyproxy and the transparent path; through the guard"
        " and direct, four helpers back to back per round, A B B A (the order swapped each"
        f" round), {PAIRED_REPEATS} GETs each, each guard helper paired with the direct"
        " one next to it. A rate is the median of all its GETs; the guard's ratio to direct"
        " is the median of the pairs' own ratios (each pair's two medians taken seconds"
        " apart), so one slow stretch of the host does not decide it."
    )
    small = detail.small
    rate = {name: statistics.median(v) for name, v in mb_s.items()}

    def p99(key: str) -> str:
        return f"p99 {small[key].p99_ms:.2f} ms" if key in small else "p99 -"

    def vs(mode: str, peer: str, goal: Goal | None = None) -> Row:
        ours, theirs = small[f"guard/{mode}"], small.get(f"{peer}/{mode}")
        what = "new connection" if mode == "new" else "keep-alive"
        return make_row(
            f"egress_{mode}_{peer}",
            f"egress: small GET, {what}, median",
            "ms",
            ours.median_ms,
            theirs.median_ms if theirs else None,
            goal,
            baseline_name=peer,
            note=f"{p99(f'guard/{mode}')} vs {p99(f'{peer}/{mode}')}",
        )

    def vs_squid_and_sync(mode: str) -> Row:
        """The guard against Squid plus the one sync Squid does not do: the part of the gap
        that is durability, and the part that is the guard."""
        theirs = small.get(f"squid/{mode}")
        what = "new connection" if mode == "new" else "keep-alive"
        return make_row(
            f"egress_{mode}_squid_sync",
            f"egress: small GET, {what}, vs Squid + 1 log sync",
            "ms",
            small[f"guard/{mode}"].median_ms,
            theirs.median_ms + sync_ms if theirs else None,
            baseline_name="squid + sync",
            note=f"the floor of durability per-call, where a forwarded request waits for its"
            f" start line's sync ({sync_ms:.2f} ms median on this disk, p99"
            f" {sync_alone.p99_ms:.2f}); in group commit (the default) no request waits for a"
            " sync; Squid syncs nothing",
        )

    at_most_squid = Goal(kind="ratio_max", threshold=1.0, text="<= 1.0x Squid")
    cpu = {name: statistics.median(v) for name, v in cpu_ms.items()}
    b.note(
        f"egress CPU: what the proxy's container used (its cgroup's CPU count, read on the"
        f" host before and after) while one {s.egress_big_mib} MiB GET went through it, the"
        " GETs alone in their own helper (the helper's count divided by its GETs); the"
        " guard's container holds the bridge and MCP ports too (idle then); medians of"
        " every helper's figure"
    )
    small_cpu = {key: statistics.median(v) for key, v in small_cpu_ms.items()}
    b.note(
        "egress CPU per small GET: what the proxy's container used (its cgroup's count, read"
        " on the host before and after each helper) over that helper's GETs, warm-up ones"
        " included; the guard's container holds its action log's writer thread too, and"
        f" the sync it makes per request; medians of {s.egress_rounds} rounds. Against the"
        " latency rows it tells a proxy that waits from one that works."
    )

    def cpu_vs_squid(mode: str) -> Row:
        what = "new connection" if mode == "new" else "keep-alive"
        extra = small_cpu.get(f"tinyproxy/{mode}")
        return make_row(
            f"egress_small_cpu_{mode}_squid",
            f"egress: proxy CPU per small GET, {what}",
            "ms",
            small_cpu.get(f"guard/{mode}"),
            small_cpu.get(f"squid/{mode}"),
            baseline_name="squid",
            note=f"tinyproxy {extra:.2f} ms" if extra is not None else "",
        )

    def transparent(mode: str, peer: str, name: str) -> Row:
        what = "new connection" if mode == "new" else "keep-alive"
        ours, theirs = small[f"transparent/{mode}"], small.get(f"{peer}/{mode}")
        return make_row(
            f"egress_{mode}_transparent_vs_{peer}",
            f"egress: small GET, {what}, direct (redirected to the guard), median",
            "ms",
            ours.median_ms,
            theirs.median_ms if theirs else None,
            baseline_name=name,
            note=f"{p99(f'transparent/{mode}')} vs {p99(f'{peer}/{mode}')}",
        )

    b.note(
        "egress, transparent: the same small GETs as the step's uid straight to the server's"
        " address, no proxy: the firewall redirects each connection to the guard, which"
        " recovers the destination and serves it through the proxy's own code path. DNS: A"
        " queries over UDP to 127.0.0.11:53 one at a time, as the step's uid (redirected to"
        " the guard's own DNS, which writes a line for each) and as the guard's uid (the"
        " engine's resolver, for the guard container's own name)."
    )
    dns_ours, dns_engine = detail.dns["guard"], detail.dns["engine"]
    rows = [
        transparent("new", "guard", "explicit proxy"),
        transparent("new", "squid", "squid"),
        transparent("keep", "guard", "explicit proxy"),
        transparent("keep", "squid", "squid"),
        make_row(
            "dns_answer",
            "dns: one A query answered, median",
            "ms",
            dns_ours.median_ms,
            dns_engine.median_ms,
            baseline_name="engine resolver",
            note=f"p99 {dns_ours.p99_ms:.2f} ms vs {dns_engine.p99_ms:.2f} ms",
        ),
    ]
    return [
        *rows,
        make_row(
            "egress_rate",
            f"egress: {s.egress_big_mib} MiB GET",
            "MB/s",
            rate["guard"],
            rate["direct"],
            Goal(kind="ratio_min", threshold=0.9, text=">= 0.9x direct"),
            baseline_name="direct",
            note=f"ratio: the median of {len(pairs)} adjacent pairs' own ratios ("
            + ", ".join(f"{g / d:.2f}x" for g, d in pairs if d > 0)
            + ")",
            paired=paired_ratio(pairs),
        ),
        make_row(
            "egress_rate_squid",
            f"egress: {s.egress_big_mib} MiB GET",
            "MB/s",
            rate["guard"],
            rate.get("squid"),
            baseline_name="squid",
        ),
        make_row(
            "egress_cpu_squid",
            f"egress: proxy CPU per {s.egress_big_mib} MiB GET",
            "ms",
            cpu.get("guard"),
            cpu.get("squid"),
            baseline_name="squid",
            note=f"tinyproxy {cpu['tinyproxy']:.0f} ms" if "tinyproxy" in cpu else "",
        ),
        make_row(
            "egress_latency",
            "egress: small GET, new connection, median",
            "ms",
            small["guard/new"].median_ms,
            small["direct/new"].median_ms,
            Goal(kind="added_max", threshold=1.0, text="< 1 ms added"),
            baseline_name="direct",
            note=f"added {small['guard/new'].median_ms - small['direct/new'].median_ms:.2f} ms"
            f"; {p99('guard/new')} vs {p99('direct/new')}",
        ),
        vs("new", "squid", at_most_squid),
        vs_squid_and_sync("new"),
        vs("new", "tinyproxy"),
        vs("keep", "squid", at_most_squid),
        make_row(
            "egress_keep_squid_p99",
            "egress: small GET, keep-alive, p99",
            "ms",
            small["guard/keep"].p99_ms,
            small["squid/keep"].p99_ms if "squid/keep" in small else None,
            Goal(kind="ratio_max", threshold=2.0, text="<= 2x Squid's"),
            baseline_name="squid",
            note=f"median {small['guard/keep'].median_ms:.2f} ms",
        ),
        vs_squid_and_sync("keep"),
        vs("keep", "direct"),
        cpu_vs_squid("new"),
        cpu_vs_squid("keep"),
    ]
