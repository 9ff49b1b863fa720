"""The executor's shell tool (`shell.py`): exit codes, clamped timeouts that kill the group.

Each test starts the executor as a real subprocess and calls it over real HTTP.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.polling import wait_for
from tests.stepside.agentworks_exec.executor import (
    DEADLINE_S,
    Exec,
)


def test_shell_runs_in_root_with_exit_code(ex: Exec) -> None:
    reply = ex.call("execute_shell_command", command="pwd; echo err >&2; exit 3")
    assert reply["data"] == {"exit_code": 3, "timed_out": False, "timeout_s": 120}
    assert reply["is_error"] is True
    assert reply["text"] == f"{ex.root}\nerr\n"
    ok = ex.call("execute_shell_command", command="echo hi > made.txt")
    assert ok["is_error"] is False and ok["data"]["exit_code"] == 0
    assert (ex.root / "made.txt").read_text() == "hi\n"


def test_shell_timeout_is_clamped_and_kills(ex: Exec) -> None:
    started = time.monotonic()
    reply = ex.call("execute_shell_command", command="echo before; sleep 30", timeout_s=0)
    elapsed = time.monotonic() - started
    assert elapsed < 10
    assert reply["is_error"] is True
    assert reply["data"]["timed_out"] is True
    assert reply["data"]["timeout_s"] == 1
    assert reply["data"]["exit_code"] == 128 + signal.SIGKILL
    assert reply["text"].startswith("before\n")
    assert "timed out after 1 s" in reply["text"]
    high = ex.call("execute_shell_command", command="true", timeout_s=100000)
    assert high["data"] == {"exit_code": 0, "timed_out": False, "timeout_s": 600}
    assert ex.call("execute_shell_command", command="true", timeout_s="x")["is_error"] is True


def test_shell_keeps_the_tail(ex: Exec) -> None:
    cmd = "python3 -c \"import sys; sys.stdout.write(''.join(str(i % 10) for i in range(20000)))\""
    reply = ex.call("execute_shell_command", command=cmd)
    full = "".join(str(i % 10) for i in range(20000))
    assert reply["data"]["exit_code"] == 0
    assert reply["text"] == "[... 12000 chars cut]\n" + full[-8000:]


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "\nState:\tZ" in status


def test_shell_timeout_kills_the_process_group(ex: Exec) -> None:
    reply = ex.call(
        "execute_shell_command", command="sleep 300 & echo $! > bg.pid; sleep 300", timeout_s=1
    )
    assert reply["data"]["timed_out"] is True
    pid = int((ex.root / "bg.pid").read_text())
    wait_for(lambda: _gone(pid), DEADLINE_S, "the background child to be killed")


def test_shell_background_with_detached_output_returns(ex: Exec) -> None:
    started = time.monotonic()
    reply = ex.call(
        "execute_shell_command", command="sleep 300 > /dev/null 2>&1 & echo $! > bg.pid; echo ok"
    )
    assert time.monotonic() - started < 10
    assert reply["text"] == "ok\n" and reply["data"]["timed_out"] is False
    pid = int((ex.root / "bg.pid").read_text())
    os.kill(pid, signal.SIGKILL)
