"""DB copy: `copy_db` of a 200 MiB WAL database vs `sqlite3 SRC .backup DST`."""

from __future__ import annotations

import os
import random
import sqlite3
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import MIB, Bench
from bench.results import DbDetail, Goal, Row, make_row
from sandbox.prepare.dbcopy import copy_db


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
