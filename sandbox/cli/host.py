"""`gc`, `doctor`, `images`, `bench`: the build host's own commands.

Text by default; `--json` prints JSON lines instead (`gc` and `images`: one object,
`doctor`: one object per check, `bench`: the saved results as one object, its progress
on stderr). `doctor` exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from collections.abc import Callable
from pathlib import Path

from sandbox.cli.output import emit, say, say_line
from sandbox.contracts.errors import ConfigError
from sandbox.contracts.exitcodes import ExitCode


def cmd_gc(args: argparse.Namespace) -> int:
    from sandbox.backends.docker import gc
    from sandbox.contracts.hostconfig import load_host_config

    dirs = [Path(p) for p in args.workflow_dir]
    backend = load_host_config(args.host_config).backend
    if backend.kind == "kubernetes":
        from sandbox.backends.choose import collect_cluster

        report = gc.GcReport()
        roots = collect_cluster(backend, report)
        report = gc.collect_host(report, roots, dirs, remove_runs=args.remove_runs)
    else:
        from sandbox.backends.docker.client import connect

        with contextlib.closing(connect()) as client:
            report = gc.collect(client, dirs, remove_runs=args.remove_runs)
    if args.json:
        emit(report)
        return ExitCode.OK
    found = False
    for field, items in report.model_dump().items():
        if field == "errors" or not items:
            continue
        found = True
        say_line(f"{field.replace('_', ' ')}: {len(items)}")
        for item in items:
            say_line(f"  {item}")
    if not found:
        say("nothing to collect")
    for item in report.errors:
        say_line(f"error: {item}", err=True)
    return ExitCode.OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from sandbox.doctor import run_checks

    checks = run_checks()
    for check in checks:
        if args.json:
            emit(check)
            continue
        mark = "FAIL" if not check.ok else ("warn" if check.warn else "ok  ")
        # A detail's own lines (its weakness, its fix) are indented under it.
        say(f"[{mark}] {check.name}: {check.detail}")
        if not check.ok and check.fix:
            say(f"       fix: {check.fix}")
    return ExitCode.OK if all(c.ok for c in checks) else ExitCode.FAILED


def cmd_images(args: argparse.Namespace) -> int:
    from sandbox.backends.docker.client import connect
    from sandbox.backends.docker.images import build_all

    with contextlib.closing(connect()) as client:
        built = build_all(client, base_image=args.base_image or None)
    if args.json:
        emit(built)
        return ExitCode.OK
    for role in ("base", "step", "guard", "mcp"):
        say_line(f"{role}: {getattr(built, role)}")
    say_line("rebuilt: " + (", ".join(built.rebuilt) or "nothing (all up to date)"))
    return ExitCode.OK


# `sandbox bench` is a development command: the benchmarks are not part of the installed
# package (they need the checkout's fake upstreams and write its `bench/results.json`), so
# an installed wheel neither offers it nor runs it.
BENCH_ELSEWHERE = (
    "`sandbox bench` runs from a source checkout (the benchmarks are not installed "
    "with the package): run `make bench` in a clone of the repository"
)


def bench_checkout() -> Path | None:
    """The source checkout this package runs from, when it holds the benchmarks."""
    checkout = Path(__file__).resolve().parents[2]
    return checkout if (checkout / "bench" / "__init__.py").is_file() else None


def _bench_main() -> Callable[[list[str]], int]:
    """The benchmarks' entry point, from the source checkout this package runs from."""
    checkout = bench_checkout()
    if checkout is None:
        raise ConfigError(BENCH_ELSEWHERE)
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    from bench.harness import main

    return main


def cmd_bench(args: argparse.Namespace) -> int:
    bench_main = _bench_main()

    argv = ["--only", args.only] if args.only else []
    argv += ["--out", args.out] if args.out else []
    argv += ["--quick"] if args.quick else []
    argv += ["--markdown"] if args.markdown else []
    argv += ["--load"] if args.load else []
    if not args.json:
        return bench_main(argv)
    # The harness speaks text: it goes to stderr, and stdout gets the saved results.
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = bench_main(argv)
    sys.stderr.write(text.getvalue())
    prefix = "results: "  # the harness's last line names the file it saved
    saved = [ln[len(prefix) :] for ln in text.getvalue().splitlines() if ln.startswith(prefix)]
    if saved:
        import json

        emit(json.loads(Path(saved[-1]).read_text()))
    else:
        emit({"results": None, "exit_code": code})
    return code
