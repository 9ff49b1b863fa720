"""Fixtures: a started executor (`start_exec`) and one with a small workflow DB (`ex`)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.polling import wait_for
from tests.stepside.agentworks_exec.executor import (
    DEADLINE_S,
    REPO,
    TOKEN,
    Exec,
    ExecFactory,
    free_port,
    healthy,
)


@pytest.fixture
def start_exec(tmp_path: Path) -> Iterator[ExecFactory]:
    started: list[subprocess.Popen[bytes]] = []

    def factory(
        cmd: list[str] | None = None,
        *,
        db_path: Path | None = None,
        extra_env: dict[str, str] | None = None,
        wait: bool = True,
        pass_fds: tuple[int, ...] = (),
    ) -> Exec:
        root = tmp_path / f"root{len(started)}"
        root.mkdir()
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "DB_PATH"}
        env.update(
            AGENTWORKS_EXEC_PORT=str(port),
            AGENTWORKS_EXEC_TOKEN=TOKEN,
            AGENTWORKS_EXEC_ROOT=str(root),
        )
        if db_path is not None:
            env["DB_PATH"] = str(db_path)
        env.update(extra_env or {})
        step = cmd or [sys.executable, "-c", "import time; time.sleep(600)"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox.stepside.agentworks_exec", "--", *step],
            cwd=REPO,
            env=env,
            pass_fds=pass_fds,
        )
        started.append(proc)
        if wait:
            wait_for(lambda: healthy(port, proc), DEADLINE_S, "the executor's health endpoint")
        return Exec(proc, port, root)

    yield factory
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def ex(start_exec: ExecFactory, tmp_path: Path) -> Exec:
    db = tmp_path / "db.sqlite"
    con = sqlite3.connect(db)
    con.executescript(
        "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT, b BLOB);"
        "INSERT INTO t (v, b) VALUES ('one', x'00ff'), ('two', NULL);"
    )
    con.commit()
    con.close()
    return start_exec(db_path=db)
