"""The wrapper (`supervisor.py`): the step's exit code, signals, environment, descriptors.

Each test starts the executor as a real subprocess and calls it over real HTTP.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
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


def test_step_exit_code_propagates(start_exec: ExecFactory) -> None:
    ex = start_exec(["sh", "-c", "sleep 1; exit 7"], wait=False)
    assert ex.proc.wait(timeout=DEADLINE_S) == 7


def test_sigterm_is_forwarded(start_exec: ExecFactory) -> None:
    ex = start_exec()
    ex.proc.send_signal(signal.SIGTERM)
    assert ex.proc.wait(timeout=DEADLINE_S) == 128 + signal.SIGTERM


def test_token_not_inherited(start_exec: ExecFactory, tmp_path: Path) -> None:
    env_file = tmp_path / "step_env.txt"
    ready = tmp_path / "ready"
    script = f"env > {env_file}; touch {ready}; exec sleep 600"
    ex = start_exec(["sh", "-c", script])
    wait_for(ready.exists, DEADLINE_S, "the step to dump its environment")
    env_text = env_file.read_text()
    assert TOKEN not in env_text
    assert "AGENTWORKS_EXEC_TOKEN" not in env_text
    assert "AGENTWORKS_EXEC_PORT" not in env_text
    # Shell tool calls do not see it either.
    reply = ex.call("execute_shell_command", command="env")
    assert TOKEN not in reply["text"] and "AGENTWORKS_EXEC" not in reply["text"].replace(
        "AGENTWORKS_EXEC_ROOT", ""
    )
    # The wrapper is not dumpable: a same-uid reader cannot get its environ.
    if os.geteuid() != 0:
        with pytest.raises(PermissionError):
            Path(f"/proc/{ex.proc.pid}/environ").read_bytes()


def test_exec_without_port(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTWORKS_EXEC")}
    env["AGENTWORKS_EXEC_TOKEN"] = TOKEN
    env_file = tmp_path / "env.txt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sandbox.stepside.agentworks_exec",
            "--",
            "sh",
            "-c",
            f"env > {env_file}; exit 5",
        ],
        cwd=REPO,
        env=env,
        timeout=DEADLINE_S,
        check=False,
    )
    assert proc.returncode == 5
    assert TOKEN not in env_file.read_text()


def test_exec_without_port_keeps_pid(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTWORKS_EXEC")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox.stepside.agentworks_exec", "--", "sh", "-c", "echo $$"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
    )
    out, _ = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0
    assert int(out) == proc.pid


@pytest.mark.parametrize(
    ("env", "cmd", "code"),
    [
        ({"AGENTWORKS_EXEC_PORT": "1234"}, ["true"], 2),  # port without token
        ({"AGENTWORKS_EXEC_PORT": "nope", "AGENTWORKS_EXEC_TOKEN": TOKEN}, ["true"], 2),
        ({}, [], 2),  # no command
        ({}, ["/nonexistent/cmd"], 127),
    ],
)
def test_startup_errors(env: dict[str, str], cmd: list[str], code: int) -> None:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTWORKS_EXEC")}
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox.stepside.agentworks_exec", "--", *cmd],
        cwd=REPO,
        env=full_env,
        timeout=DEADLINE_S,
        capture_output=True,
        check=False,
    )
    assert proc.returncode == code, proc.stderr


def test_missing_command_with_server_is_127(start_exec: ExecFactory) -> None:
    ex = start_exec(["/nonexistent/cmd"], wait=False)
    assert ex.proc.wait(timeout=DEADLINE_S) == 127


def test_runs_standalone_in_the_step_image_layout(tmp_path: Path) -> None:
    """Laid out as the step image installs it, without the sandbox package."""
    lib = tmp_path / "lib"
    lib.mkdir()
    from sandbox.backends.docker.images import stage_step_side

    stage_step_side(lib)  # exactly what the step image installs
    root = tmp_path / "group"
    root.mkdir()
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(lib),
        "AGENTWORKS_EXEC_PORT": str(port),
        "AGENTWORKS_EXEC_TOKEN": TOKEN,
    }
    # -S: no site-packages, so neither `sandbox` nor pydantic can be imported.
    proc = subprocess.Popen(
        [sys.executable, "-S", "-m", "agentworks_exec", "--", "sleep", "600"], cwd=root, env=env
    )
    try:
        wait_for(lambda: healthy(port, proc), DEADLINE_S, "the standalone executor")
        ex = Exec(proc, port, root)
        assert ex.call("write_file", path="x.txt", content="hi")["is_error"] is False
        assert (root / "x.txt").read_text() == "hi"
        assert "refused" in ex.call("read_file", path="../x")["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=DEADLINE_S)


def test_a_command_that_exits_at_once_keeps_its_exit_code(ex: Exec) -> None:
    """The executor reaps orphans as pid 1; a shell that exits before its tool thread has
    registered it must still be waited for by that thread, never reaped as a stranger."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        codes = list(
            pool.map(
                lambda _: ex.call("execute_shell_command", command="exit 3")["data"]["exit_code"],
                range(200),
            )
        )
    assert codes == [3] * 200


# What the executor's start-up (everything before the step runs) must not load: the
# server, the tools and their imports come at the guard's first call, after the start.
NOT_BEFORE_THE_STEP = (
    "agentworks_exec.server",
    "agentworks_exec.executor",
    "agentworks_exec.shell",
    "http.server",
    "sqlite3",
    "subprocess",
    "typing",
    "contextlib",
)


def test_the_start_up_path_loads_neither_the_server_nor_the_tools(tmp_path: Path) -> None:
    """Checked through `sys.modules` in the step image's layout, never by timing."""
    from sandbox.backends.docker.images import stage_step_side

    lib = tmp_path / "lib"
    lib.mkdir()
    stage_step_side(lib)
    code = "import json, sys\nimport agentworks_exec.supervisor\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(lib)},
        capture_output=True,
        text=True,
        check=True,
        timeout=DEADLINE_S,
    )
    loaded = set(json.loads(done.stdout)) - {"json", "json.decoder", "json.encoder", "json.scanner"}
    assert "agentworks_exec.supervisor" in loaded  # the check sees real imports
    assert [name for name in NOT_BEFORE_THE_STEP if name in loaded] == []


def test_the_step_inherits_no_descriptor_but_its_three(
    start_exec: ExecFactory, tmp_path: Path
) -> None:
    """The step is started as `Popen(close_fds=True)` would: an inheritable descriptor the
    executor was given does not reach it."""
    listing = tmp_path / "fds.txt"
    ready = tmp_path / "ready"
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)
    try:
        script = f"ls /proc/self/fd > {listing}; touch {ready}; exec sleep 600"
        env = {"AGENTWORKS_TEST_FD": str(write_end)}
        ex = start_exec(["sh", "-c", script], extra_env=env, pass_fds=(write_end,))
        wait_for(ready.exists, DEADLINE_S, "the step to list its descriptors")
        assert Path(f"/proc/{ex.proc.pid}/fd/{write_end}").exists()  # the executor has it
        fds = {int(n) for n in listing.read_text().split()}
        assert write_end not in fds
        assert {0, 1, 2} <= fds
    finally:
        os.close(read_end)
        os.close(write_end)


def test_the_step_gets_default_sigpipe(start_exec: ExecFactory, tmp_path: Path) -> None:
    """Python ignores SIGPIPE; the step gets it back at its default, as from Popen."""
    status = tmp_path / "status.txt"
    ready = tmp_path / "ready"
    script = f"grep -E '^SigIgn' /proc/self/status > {status}; touch {ready}; exec sleep 600"
    start_exec(["sh", "-c", script])
    wait_for(ready.exists, DEADLINE_S, "the step to report its ignored signals")
    ignored = int(status.read_text().split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))
    assert not ignored & (1 << (signal.SIGXFSZ - 1))


# The executor under a kernel that refuses the wait for the first call (the step's
# seccomp profile under runsc did, with EPERM): the step then asks its own port.
REFUSED_WAIT = """
import select, sys
def refused(*args, **kwargs):
    raise PermissionError(1, "Operation not permitted")
select.select = refused
from sandbox.stepside.agentworks_exec.supervisor import main
sys.exit(main(sys.argv[1:]))
"""

ASK_THE_PORT = """
import os, socket, sys, time
port = int(sys.argv[1])
end = time.monotonic() + 10
while True:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"GET /v1/health HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
            got = conn.recv(100)
    except (ConnectionRefusedError, ConnectionResetError) as exc:
        print(type(exc).__name__)
        break
    except OSError as exc:
        print("OTHER", exc)
        break
    if time.monotonic() > end:
        print("ANSWERED" if got else "HUNG")
        break
    time.sleep(0.01)  # connected before the executor's thread closed the listener
"""


def test_an_executor_that_cannot_wait_for_calls_refuses_them_and_says_why(
    tmp_path: Path,
) -> None:
    """A tool call must fail at once, not hang in the backlog until the step's timeout."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DB_PATH"}
    env.update(
        AGENTWORKS_EXEC_PORT=str(port),
        AGENTWORKS_EXEC_TOKEN=TOKEN,
        AGENTWORKS_EXEC_ROOT=str(tmp_path),
    )
    done = subprocess.run(
        [sys.executable, "-c", REFUSED_WAIT, "--", sys.executable, "-c", ASK_THE_PORT, str(port)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in {"ConnectionRefusedError", "ConnectionResetError"}, done.stdout
    assert "agentworks_exec: cannot wait for tool calls: [Errno 1]" in done.stderr
