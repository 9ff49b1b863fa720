"""The escape battery's shared machinery.

Every module here makes ONE real test run whose step is a hostile script: it
tries many escapes in a row, each wrapped by `attempt()`, which prints one
JSON line `{"name", "outcome", "detail", "data"}` on stdout (the outcome is
the errno name, the exception class, or what the attempt managed to do). The
pytest side then asserts one safe outcome per attempt (parametrized, so each
attempt is its own test with its own message), plus what must hold after
every run: the real workflow folder is byte-identical and no container of the
run is left.

`STEP_PRELUDE` is prepended to every step script: python3, stdlib only.
"""

from __future__ import annotations

import json
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from docker import DockerClient

from sandbox.contracts.names import LABEL_RUN_ID
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.run.testrun import RunOptions, TestRun
from tests.conftest import DEFAULT_DB_SQL, tree_digest, write_workflow

STEP_PRELUDE = r'''
import ctypes, errno, json, os, signal, sys

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long


def errname(exc):
    """ENOENT-style name of an OSError, else the exception class name."""
    if isinstance(exc, OSError) and exc.errno:
        return errno.errorcode.get(exc.errno, "errno%d" % exc.errno)
    return type(exc).__name__


def report(name, outcome, detail="", data=None):
    # Compact: the record keeps only the last 8000 characters of stdout. An errno
    # name says it all; other outcomes carry a short detail.
    line = {"name": name, "outcome": outcome}
    if detail and outcome not in errno.errorcode.values():
        line["detail"] = str(detail)[:100]
    if data is not None:
        line["data"] = data
    print(json.dumps(line, separators=(",", ":")), flush=True)


def run_attempt(fn):
    """(outcome, detail, data): an exception is its errno name; None is DONE."""
    try:
        result = fn()
    except BaseException as exc:
        return errname(exc), str(exc), None
    if result is None:
        return "DONE", "", None
    if isinstance(result, tuple):
        result = list(result)
        while len(result) < 3:
            result.append("" if len(result) == 1 else None)
        return tuple(result)
    return str(result), "", None


def attempt(name, fn):
    report(name, *run_attempt(fn))


def in_child(fn):
    """Run fn in a forked child, so a surprise success cannot change this process."""
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, json.dumps(run_attempt(fn)).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        raw = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name, "the child was killed by a signal"
    return tuple(json.loads(raw))


def sys_call(nr, *args):
    """A raw x86_64 syscall; -1 becomes OSError(errno)."""
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    ctypes.set_errno(0)
    ret = LIBC.syscall(ctypes.c_long(nr), *conv)
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret
'''


@dataclass
class Attempt:
    name: str
    outcome: str
    detail: str = ""
    data: Any = None


@dataclass
class Battery:
    """One hostile test run and everything the assertions need from it."""

    record: TestRunRecord
    attempts: dict[str, Attempt]
    stray_stdout: list[str]
    before: dict[str, str]
    after: dict[str, str]
    leftovers: list[str]
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return Path(self.record.workflow_dir) / "runs" / self.record.id

    def action_lines(self) -> list[str]:
        return (self.run_dir / "test_mode_actions.jsonl").read_text().splitlines()

    def outcome(self, name: str) -> Attempt:
        found = self.attempts.get(name)
        assert found is not None, (
            f"the step never reported attempt {name!r} (it died or the name changed); "
            f"status={self.record.status} reason={self.record.reason!r} "
            f"stderr tail: {self.record.stderr.text[-600:]!r}"
        )
        return found


def build_workflow(
    root: Path,
    script: str,
    *,
    name: str = "wf",
    extra_toml: str = "",
    prompt: str | None = None,
    earlier_files: dict[str, str] | None = None,
    db_sql: str | None = DEFAULT_DB_SQL,
    timeout_s: float = 60,
) -> Path:
    """`<root>/<name>/` with the hostile script as its one step (see `write_workflow`)."""
    wf = write_workflow(
        root,
        name,
        command=["python3", "/workflow/code/step.py"],
        timeout_s=timeout_s,
        db_sql=db_sql,
        earlier_files=earlier_files,
        extra_toml=extra_toml,
        prompt=prompt,
    )
    (wf / "code" / "step.py").write_text(STEP_PRELUDE + "\n" + textwrap.dedent(script))
    return wf


def parse_attempts(stdout: str) -> tuple[dict[str, Attempt], list[str]]:
    attempts: dict[str, Attempt] = {}
    stray: list[str] = []
    for line in stdout.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            stray.append(line)
            continue
        if not isinstance(item, dict) or "name" not in item or "outcome" not in item:
            stray.append(line)
            continue
        assert item["name"] not in attempts, f"attempt {item['name']!r} reported twice"
        attempts[item["name"]] = Attempt(
            item["name"], str(item["outcome"]), str(item.get("detail", "")), item.get("data")
        )
    return attempts, stray


def run_battery(engine: DockerClient, wf: Path, options: RunOptions | None = None) -> Battery:
    """One real test run of the hostile step, with the before/after evidence."""
    before = tree_digest(wf)
    started = time.monotonic()
    record = TestRun(wf, "step1", options or RunOptions()).execute()
    wall_s = time.monotonic() - started
    after = tree_digest(wf)
    leftovers = [
        str(c.name)
        for c in engine.containers.list(all=True, filters={"label": f"{LABEL_RUN_ID}={record.id}"})
    ]
    attempts, stray = parse_attempts(record.stdout.text)
    return Battery(record, attempts, stray, before, after, leftovers, wall_s)


def assert_left_no_trace(battery: Battery) -> None:
    """What must hold after every hostile run, whatever the step did."""
    changed = sorted(
        k
        for k in battery.before.keys() | battery.after.keys()
        if battery.before.get(k) != battery.after.get(k)
    )
    assert changed == [], f"the real workflow folder changed: {changed}"
    assert battery.leftovers == [], f"containers left behind: {battery.leftovers}"
    assert not battery.record.stdout.truncated, (
        "the step's report was cut; keep attempt details short"
    )


def assert_passed_without_trace(battery: Battery) -> None:
    """A battery whose step survives all its attempts: the run passed, nothing changed,
    and the step printed nothing but attempt reports."""
    assert battery.record.status is RunStatus.PASSED, (
        f"{battery.record.reason}; stderr: {battery.record.stderr.text[-800:]}"
    )
    assert_left_no_trace(battery)
    assert battery.stray_stdout == [], battery.stray_stdout


def assert_attempts_match(
    battery: Battery, safe: dict[str, set[str]], optional: frozenset[str] = frozenset()
) -> None:
    """Every attempt the step reported has an expected outcome, and every expected one
    was reported (`optional` ones may be missing from the report)."""
    assert sorted(set(battery.attempts) - set(safe) - optional) == []
    assert sorted(set(safe) - set(battery.attempts)) == []


def attempt_params(safe: dict[str, set[str]], known_holes: dict[str, str]) -> list[object]:
    """One test per attempt; a known hole is a strict xfail, so closing it is noticed."""
    return [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=known_holes[name]))
        if name in known_holes
        else name
        for name in safe
    ]


def check(battery: Battery, name: str, safe: set[str]) -> Attempt:
    """Assert one attempt ended in one of its safe outcomes."""
    got = battery.outcome(name)
    assert got.outcome in safe, (
        f"ESCAPE? {name!r} ended in {got.outcome!r} (detail: {got.detail!r}, "
        f"data: {got.data!r}); the safe outcomes are {sorted(safe)}"
    )
    return got
