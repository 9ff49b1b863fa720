"""Escape battery, run 1 of 3: files, mounts, /proc, privileges, devices, the guard.

One real test run; the step (in `filesystemparts.py`) tries every attempt there
as uid 10001 inside its container and reports each outcome. The workflow has a
WAL-mode DB with an uncheckpointed `-wal` file, a Crew folder and a prompt, so
every read-only mount the README lists is present. At the end the step plants traps for the
host-side collector (FIFOs, links to a host secret) and the run must still
finish without reading through them.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.contracts.record import read_record
from tests.security.conftest import (
    Battery,
    assert_attempts_match,
    assert_passed_without_trace,
    attempt_params,
    build_workflow,
    check,
    run_battery,
)
from tests.security.filesystemparts import HOST_SECRET, SAFE, STEP

pytestmark = pytest.mark.engine

# Attempts that currently SUCCEED: a real hole, reported with a proposed fix.
# strict=True: once the hole is closed these XPASS and fail, so the marker must go.
KNOWN_HOLES: dict[str, str] = {}


@pytest.fixture(scope="module")
def battery(engine: DockerClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Battery]:
    root = tmp_path_factory.mktemp("sec-fs")
    crew = root / "crew-a"
    crew.mkdir()
    (crew / "crew.txt").write_text("crew data")
    secret = root / "host-secret.txt"
    secret.write_text(HOST_SECRET)
    wf = build_workflow(
        root,
        STEP.replace("@@HOST_SECRET_PATH@@", str(secret)),
        extra_toml=f'[[crew_folders]]\nname = "a"\npath = "{crew}"\n',
        prompt="Do the thing.\n",
        earlier_files={"keep.txt": "keep"},
    )
    # WAL mode with a committed row not yet checkpointed: the -wal and -shm files
    # exist during the run (closing the connection would checkpoint them away).
    con = sqlite3.connect(wf / "db" / "db.sqlite")
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("INSERT INTO t VALUES (7, 'wal-row')")
    con.commit()
    assert (wf / "db" / "db.sqlite-wal").stat().st_size > 0
    # World-writable modes, so that the read-only MOUNT is the only thing in the way
    # (with the usual 0644 root-owned files, EACCES would hide a writable mount).
    for path in [wf, *wf.rglob("*"), crew, *crew.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)
    try:
        result = run_battery(engine, wf)
        result.extra["secret"] = secret
        yield result
    finally:
        con.close()


def test_run_finished_and_left_no_trace(battery: Battery) -> None:
    assert_passed_without_trace(battery)


def test_every_reported_attempt_is_asserted(battery: Battery) -> None:
    assert_attempts_match(battery, SAFE)


@pytest.mark.parametrize("name", attempt_params(SAFE, KNOWN_HOLES))
def test_attempt_is_contained(battery: Battery, name: str) -> None:
    check(battery, name, SAFE[name])


def test_record_and_action_log_were_not_forged(battery: Battery) -> None:
    # No bridge calls were made, so the guard wrote nothing; the step wrote nothing either.
    assert battery.action_lines() == []
    on_disk = read_record(battery.run_dir)
    assert on_disk.model_dump() == battery.record.model_dump()
    assert "ESCAPED" not in (battery.run_dir / "test_mode.json").read_text()


def test_host_collector_never_read_through_the_traps(battery: Battery) -> None:
    """FIFOs and links to a host secret in the group folder and the DB folder."""
    record = battery.record
    secret: Path = battery.extra["secret"]
    assert battery.outcome("host-side traps planted").outcome == "planted"
    assert battery.wall_s < 60, f"the runner took {battery.wall_s:.1f} s: did it block on a FIFO?"
    assert secret.read_text() == HOST_SECRET
    assert HOST_SECRET not in (battery.run_dir / "test_mode.json").read_text()
    assert HOST_SECRET not in record.model_dump_json()
    assert record.db_diff is not None and record.db_diff.error, (
        "the DB copy was replaced by a FIFO; the diff must report an error, not read it"
    )
    link = battery.run_dir / "g" / "trap-secret-link"
    assert link.is_symlink() and Path(link.readlink()) == secret
