"""Tests for the step executor (sandbox.stepside.agentworks_exec), over real HTTP, as a real subprocess.

No Docker and no mocks: every test starts ``python -m sandbox.stepside.agentworks_exec -- <cmd>``
with a port, a token and ``AGENTWORKS_EXEC_ROOT`` pointing at a temp folder,
waits for ``/v1/health`` and calls tools with urllib.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import paths
from tests.polling import wait_for

REPO = paths.REPO
TOKEN = "t0k3n-for-tests-0123456789abcdef"
DEADLINE_S = 15.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    token: str | None = TOKEN,
    timeout: float = 30,
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@dataclass
class Exec:
    proc: subprocess.Popen[bytes]
    port: int
    root: Path

    def call(self, tool: str, **arguments: Any) -> dict[str, Any]:
        body = json.dumps({"tool": tool, "arguments": arguments}).encode()
        status, reply = http(self.port, "POST", "/v1/exec", body)
        assert status == 200, reply
        assert set(reply) == {"text", "data", "is_error"}
        return dict(reply)


def healthy(port: int, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"executor exited early with {proc.returncode}"
    try:
        return http(port, "GET", "/v1/health", token=None, timeout=2) == (200, {"ok": True})
    except OSError:
        return False


ExecFactory = Callable[..., Exec]


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


# --------------------------------------------------------------------------- HTTP layer


def test_health_needs_no_token(ex: Exec) -> None:
    assert http(ex.port, "GET", "/v1/health", token=None) == (200, {"ok": True})


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_bad_token_is_401(ex: Exec, token: str | None) -> None:
    body = json.dumps({"tool": "list_dir", "arguments": {}}).encode()
    status, reply = http(ex.port, "POST", "/v1/exec", body, token=token)
    assert status == 401
    assert "error" in reply


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"arguments": {}}',
        b'{"tool": "", "arguments": {}}',
        b'{"tool": 3}',
        b'{"tool": "list_dir", "arguments": []}',
        b'{"tool": "list_dir", "extra": 1}',
    ],
)
def test_malformed_body_is_400(ex: Exec, body: bytes) -> None:
    status, reply = http(ex.port, "POST", "/v1/exec", body)
    assert status == 400
    assert reply["error"]


def test_oversized_body_is_413(ex: Exec) -> None:
    body = b'{"tool": "list_dir", "arguments": {"x": "' + b"a" * (4 * 1024 * 1024) + b'"}}'
    status, reply = http(ex.port, "POST", "/v1/exec", body)
    assert status == 413
    assert "larger" in reply["error"]
    # The server is still fine afterwards.
    assert ex.call("list_dir")["is_error"] is False


def test_arguments_default_and_unknown_tool(ex: Exec) -> None:
    status, reply = http(ex.port, "POST", "/v1/exec", b'{"tool": "list_dir"}')
    assert status == 200 and reply["is_error"] is False
    reply = ex.call("send_email", to="x")
    assert reply["is_error"] is True
    assert "unknown local tool" in reply["text"]


def test_unknown_endpoint_is_404(ex: Exec) -> None:
    assert http(ex.port, "GET", "/v1/nope")[0] == 404
    assert http(ex.port, "POST", "/v1/nope", b"{}")[0] == 404


# --------------------------------------------------------------------------- files


def test_write_read_roundtrip(ex: Exec) -> None:
    reply = ex.call("write_file", path="out/sub/a.txt", content="l0\nl1\nl2\nl3\n")
    assert reply["is_error"] is False, reply
    assert (ex.root / "out/sub/a.txt").read_text() == "l0\nl1\nl2\nl3\n"
    assert ex.call("read_file", path="out/sub/a.txt")["text"] == "l0\nl1\nl2\nl3\n"
    reply = ex.call("read_file", path="./out//sub/a.txt", offset=1, limit=2)
    assert reply["text"] == "l1\nl2\n"
    assert reply["data"]["next_offset"] == 3
    assert ex.call("read_file", path="nope.txt")["is_error"] is True
    assert ex.call("read_file", path="out")["is_error"] is True


def test_read_is_capped(ex: Exec) -> None:
    (ex.root / "big.txt").write_text(("x" * 1023 + "\n") * 300)  # 300 KiB
    reply = ex.call("read_file", path="big.txt")
    assert reply["is_error"] is False
    assert reply["data"]["truncated"] is True
    assert reply["text"].startswith("x" * 1023 + "\n")
    body, note = reply["text"].rsplit("\n[... cut at 256 KiB", 1)
    assert len(body.encode()) == 256 * 1024
    assert "offset=257" in note


REFUSED_PATHS = ["../x", "a/../../x", "/etc/passwd", "~/x", "~", ".git/config", "a/.GIT/x", ""]


@pytest.mark.parametrize("path", REFUSED_PATHS)
def test_unsafe_paths_refused(ex: Exec, path: str) -> None:
    for tool, extra in [
        ("read_file", {}),
        ("write_file", {"content": "x"}),
        ("edit_file", {"old": "a", "new": "b"}),
        ("list_dir", {}),
        ("search_files", {"pattern": "x"}),
    ]:
        reply = ex.call(tool, path=path, **extra)
        assert reply["is_error"] is True, (tool, reply)
        assert "refused:" in reply["text"], (tool, reply)


def test_symlink_out_of_root_refused(ex: Exec, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    (ex.root / "out_dir").symlink_to(outside)
    (ex.root / "out_file").symlink_to(outside / "secret.txt")
    calls: list[tuple[str, dict[str, Any]]] = [
        ("read_file", {"path": "out_file"}),
        ("read_file", {"path": "out_dir/secret.txt"}),
        ("write_file", {"path": "out_dir/new.txt", "content": "x"}),
        ("write_file", {"path": "out_file", "content": "x"}),
        ("edit_file", {"path": "out_file", "old": "secret", "new": "x"}),
        ("list_dir", {"path": "out_dir"}),
        ("search_files", {"pattern": "secret", "path": "out_dir"}),
    ]
    for tool, args in calls:
        reply = ex.call(tool, **args)
        assert reply["is_error"] is True, (tool, reply)
        assert "refused: path leaves the group folder via a symlink" in reply["text"]
    assert (outside / "secret.txt").read_text() == "secret"
    assert not (outside / "new.txt").exists()
    # A search from the root does not follow the links out either.
    reply = ex.call("search_files", pattern="secret")
    assert reply["text"] == "no matches"


def test_write_never_follows_a_final_symlink(ex: Exec) -> None:
    (ex.root / "real.txt").write_text("real")
    (ex.root / "link.txt").symlink_to("real.txt")
    reply = ex.call("write_file", path="link.txt", content="new")
    assert reply["is_error"] is True
    assert "symlink" in reply["text"]
    assert (ex.root / "real.txt").read_text() == "real"
    # Reading through a link that stays inside the root is fine.
    assert ex.call("read_file", path="link.txt")["text"] == "real"


def test_edit_exactly_once(ex: Exec) -> None:
    (ex.root / "e.txt").write_text("alpha beta beta\r\n")
    reply = ex.call("edit_file", path="e.txt", old="alpha", new="ALPHA")
    assert reply["is_error"] is False, reply
    assert (ex.root / "e.txt").read_bytes() == b"ALPHA beta beta\r\n"
    reply = ex.call("edit_file", path="e.txt", old="beta", new="x")
    assert reply["is_error"] is True
    assert "old text occurs 2 times" in reply["text"]
    reply = ex.call("edit_file", path="e.txt", old="gamma", new="x")
    assert reply["is_error"] is True
    assert "old text occurs 0 times" in reply["text"]
    assert (ex.root / "e.txt").read_bytes() == b"ALPHA beta beta\r\n"
    assert ex.call("edit_file", path="e.txt", old="", new="x")["is_error"] is True
    assert ex.call("edit_file", path="missing.txt", old="a", new="b")["is_error"] is True


def test_list_dir(ex: Exec) -> None:
    (ex.root / "b.txt").write_text("")
    (ex.root / "a_dir").mkdir()
    (ex.root / "a_dir" / "inner").write_text("")
    (ex.root / "c_link").symlink_to("b.txt")
    reply = ex.call("list_dir")
    assert reply["is_error"] is False
    assert reply["data"]["entries"] == ["a_dir/", "b.txt", "c_link -> b.txt"]
    assert reply["text"] == "a_dir/\nb.txt\nc_link -> b.txt"
    assert ex.call("list_dir", path="a_dir")["data"]["entries"] == ["inner"]
    assert ex.call("list_dir", path="b.txt")["is_error"] is True


def test_list_dir_cap(ex: Exec) -> None:
    many = ex.root / "many"
    many.mkdir()
    for i in range(1005):
        (many / f"f{i:04d}").write_text("")
    reply = ex.call("list_dir", path="many")
    assert len(reply["data"]["entries"]) == 1000
    assert reply["data"]["truncated"] is True
    assert "5 more entries" in reply["text"]


def test_search_files(ex: Exec) -> None:
    (ex.root / "src").mkdir()
    (ex.root / "src" / "a.py").write_text("import os\nneedle = 1\n")
    (ex.root / "src" / "b.txt").write_text("no\nneedle here\n")
    (ex.root / "bin.dat").write_bytes(b"\x00needle")
    (ex.root / "huge.txt").write_text("needle\n" + "x" * (2 * 1024 * 1024))
    (ex.root / ".git").mkdir()
    (ex.root / ".git" / "config").write_text("needle\n")
    reply = ex.call("search_files", pattern=r"need+le")
    assert reply["is_error"] is False
    assert reply["text"] == "src/a.py:2: needle = 1\nsrc/b.txt:2: needle here"
    assert reply["data"]["matches"][0] == {"path": "src/a.py", "line": 2, "text": "needle = 1"}
    assert ex.call("search_files", pattern="needle", glob="*.py")["text"] == (
        "src/a.py:2: needle = 1"
    )
    assert ex.call("search_files", pattern="needle", path="src/b.txt")["text"] == (
        "src/b.txt:2: needle here"
    )
    bad = ex.call("search_files", pattern="(")
    assert bad["is_error"] is True and "invalid regular expression" in bad["text"]


def test_search_match_cap(ex: Exec) -> None:
    (ex.root / "m.txt").write_text("hit\n" * 600)
    reply = ex.call("search_files", pattern="hit")
    assert len(reply["data"]["matches"]) == 500
    assert reply["data"]["truncated"] is True
    assert "match cap 500" in reply["text"]


# --------------------------------------------------------------------------- shell


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


# --------------------------------------------------------------------------- DB


def test_query_workflow_db(ex: Exec) -> None:
    reply = ex.call("query_workflow_db", sql="SELECT id, v, b FROM t WHERE id >= ?", params=[1])
    assert reply["is_error"] is False, reply
    assert reply["data"] == {
        "columns": ["id", "v", "b"],
        "rows": [[1, "one", "00ff"], [2, "two", None]],
        "truncated": False,
    }
    assert reply["text"].splitlines()[0] == "id | v | b"
    assert "2 rows" in reply["text"]


def test_query_workflow_db_is_read_only(ex: Exec, tmp_path: Path) -> None:
    reply = ex.call("query_workflow_db", sql="INSERT INTO t (v) VALUES ('sneaky')")
    assert reply["is_error"] is True
    assert "readonly" in reply["text"]
    con = sqlite3.connect(tmp_path / "db.sqlite")
    assert con.execute("SELECT count(*) FROM t").fetchone() == (2,)
    con.close()
    two = ex.call("query_workflow_db", sql="SELECT 1; SELECT 2")
    assert two["is_error"] is True


def test_query_rows_are_capped(ex: Exec) -> None:
    sql = (
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n LIMIT 1500) SELECT i FROM n"
    )
    reply = ex.call("query_workflow_db", sql=sql)
    assert len(reply["data"]["rows"]) == 1000
    assert reply["data"]["truncated"] is True


@pytest.mark.parametrize("tool", ["mutate_workflow_db", "agentworks_db"])
def test_mutate_workflow_db(ex: Exec, tool: str, tmp_path: Path) -> None:
    reply = ex.call(tool, sql="INSERT INTO t (v) VALUES (?)", params=["three"])
    assert reply["is_error"] is False, reply
    assert reply["data"] == {"rowcount": 1, "lastrowid": 3}
    reply = ex.call(tool, sql="UPDATE t SET v = :v WHERE id = 1 RETURNING id, v", params={"v": "z"})
    assert reply["data"]["rows"] == [[1, "z"]]
    con = sqlite3.connect(tmp_path / "db.sqlite")
    assert con.execute("SELECT v FROM t ORDER BY id").fetchall() == [("z",), ("two",), ("three",)]
    con.close()
    attach = ex.call(tool, sql=f"ATTACH DATABASE '{tmp_path / 'other.db'}' AS o")
    assert attach["is_error"] is True
    assert ex.call(tool, sql="SELEC nonsense")["is_error"] is True


def test_db_tools_without_db(start_exec: ExecFactory) -> None:
    ex = start_exec()
    for tool in ["query_workflow_db", "mutate_workflow_db", "agentworks_db"]:
        reply = ex.call(tool, sql="SELECT 1")
        assert reply["is_error"] is True
        assert "no DB in this test run" in reply["text"]


def test_db_missing_file_is_not_created(start_exec: ExecFactory, tmp_path: Path) -> None:
    ex = start_exec(db_path=tmp_path / "absent.sqlite")
    assert ex.call("mutate_workflow_db", sql="CREATE TABLE x (a)")["is_error"] is True
    assert not (tmp_path / "absent.sqlite").exists()


# --------------------------------------------------------------------------- the wrapper


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
