"""The CLI as a controller in another language drives it: a process per command,
`--json`, every stdout line parsed as one JSON object, the exit codes of the table, an
error as one JSON object on stderr, and `sandbox lock --shared` keeping test runs out
while a normal run's command runs; and the Go example (`examples/go-controller/`),
built with the standard library only and run against a real run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from docker import DockerClient

from sandbox.contracts.events import SCHEMA_PATH as EVENTS_SCHEMA
from sandbox.contracts.exitcodes import ExitCode
from tests import paths
from tests.conftest import WorkflowFactory

pytestmark = pytest.mark.engine

GO_EXAMPLE = paths.REPO / "examples" / "go-controller"

STEP = (
    "import agentworks_bridge as b\n"
    'b.call("upwork_submit_proposal", {"job_id": 42, "text": "hire me"})\n'
    'print("submitted")\n'
)
EXPECT = '[[steps.expect]]\nkind = "status"\nexit_code = 0\n'


def sandbox(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        input=stdin,
        env=dict(os.environ),
    )


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line one JSON object, the last too; nothing else on the stream."""
    assert text.endswith("\n"), text[-200:]
    out = []
    for line in text.splitlines():
        value = json.loads(line)
        assert isinstance(value, dict), line
        out.append(value)
    return out


def the_error(done: subprocess.CompletedProcess[str], code: ExitCode) -> str:
    """An error in JSON mode: the exit code, nothing on stdout, one object on stderr."""
    assert done.returncode == code, done.stdout + done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    body = json.loads(line)
    assert set(body) == {"error"} and body["error"]["kind"] == code.kind
    message: str = body["error"]["message"]
    return message


def start_normal_run(
    wrapper: list[str], options: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """A normal run's command under `wrapper` (which takes the shared lock): it says it
    started, then holds on until its stdin closes and exits 5. Returns once it started."""
    normal = subprocess.Popen(
        [
            *wrapper,
            *options,
            sys.executable,
            "-c",
            "import sys; print('started', flush=True); sys.stdin.read(); sys.exit(5)",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert normal.stdout is not None and normal.stdout.readline() == "started\n"
    return normal


@pytest.fixture
def workflow(make_workflow: WorkflowFactory) -> Path:
    wf = make_workflow(command="python3 /workflow/code/submit.py", extra_toml=EXPECT)
    (wf / "code" / "submit.py").write_text(STEP)
    return wf


def test_follow_json_is_events_then_the_record_one_object_per_line(
    engine: DockerClient, workflow: Path
) -> None:
    schema = json.loads(EVENTS_SCHEMA.read_text())
    for command in ("run", "verify"):
        done = sandbox(command, str(workflow), "step1", "--follow", "--json")
        assert done.returncode == ExitCode.OK, done.stdout + done.stderr
        *events, last = json_lines(done.stdout)
        for event in events:
            jsonschema.validate(event, schema)
        kinds = [e["kind"] for e in events]
        assert kinds[0] == "step_start" and kinds[-1] == "step_end", kinds
        stubbed = [e for e in events if e["kind"] == "action" and e["decision"] == "stub"]
        assert [e["tool"] for e in stubbed] == ["upwork_submit_proposal"]
        if command == "run":
            assert last["status"] == "passed" and last["step_id"] == "step1"
        else:
            assert last["passed"] is True and last["digest"]["status"] == "passed"

    gate = sandbox("gate", str(workflow), "step1", "--json")
    assert gate.returncode == ExitCode.OK, gate.stdout + gate.stderr
    (answer,) = json_lines(gate.stdout)
    assert answer["ok"] is True and answer["reason"]
    listed = json_lines(sandbox("list", str(workflow), "--json").stdout)
    assert [e["kind"] for e in listed].count("test_run") == 2
    assert [e["status"] for e in listed if e["kind"] == "test_run"] == ["passed", "passed"]
    assert [e["kind"] for e in listed][-1] == "verification"
    run_dir = workflow / "runs" / listed[0]["run_id"]
    (shown,) = json_lines(sandbox("show", str(run_dir), "--json").stdout)
    assert shown["id"] == listed[0]["run_id"]


def test_errors_in_json_mode_are_one_object_on_stderr_with_the_tables_code(
    engine: DockerClient, workflow: Path, tmp_path: Path
) -> None:
    missing = str(tmp_path / "no-such-workflow")
    assert "workflow folder not found" in the_error(
        sandbox("run", missing, "step1", "--json"), ExitCode.CONFIG
    )
    assert "unknown step 'nope'" in the_error(
        sandbox("verify", str(workflow), "nope", "--json"), ExitCode.CONFIG
    )
    assert "required" in the_error(sandbox("run", "--json"), ExitCode.USAGE)
    assert "invalid choice" in the_error(sandbox("nope", "--json"), ExitCode.USAGE)
    assert "give a step to gate" in the_error(
        sandbox("gate", str(workflow), "--json"), ExitCode.USAGE
    )
    assert "no test_mode.json" in the_error(
        sandbox("show", str(tmp_path), "--json"), ExitCode.CONFIG
    )
    # Without --json the same error is one line of text.
    text = sandbox("run", missing, "step1")
    assert text.returncode == ExitCode.CONFIG
    assert text.stderr.startswith("sandbox: error: workflow folder not found")


def test_a_normal_run_under_sandbox_lock_keeps_test_runs_out(
    engine: DockerClient, workflow: Path
) -> None:
    # The normal run: a command that says it started, then waits for its stdin to close.
    normal = start_normal_run(
        [sys.executable, "-m", "sandbox.cli", "lock", "--shared", str(workflow)],
        ["--owner", "controller run 17", "--"],
    )
    try:
        for command in ("run", "verify"):
            refused = sandbox(command, str(workflow), "step1", "--json")
            assert refused.returncode == ExitCode.REFUSED, refused.stdout + refused.stderr
            (last,) = json_lines(refused.stdout)
            status = last["status"] if command == "run" else last["digest"]["status"]
            assert status == "refused"
        # Normal runs share the lock.
        shared = sandbox("lock", "--shared", str(workflow), "--", "true")
        assert shared.returncode == 0, shared.stderr
        # A second holder that wants the workflow alone is refused, as JSON when asked.
        alone = sandbox("lock", "--exclusive", str(workflow), "--json", "--", "true")
        assert "controller run 17" in the_error(alone, ExitCode.REFUSED)
    finally:
        _, err = normal.communicate("", timeout=60)
    assert normal.returncode == 5, err  # the command's own exit code
    assert sandbox("run", str(workflow), "step1").returncode == ExitCode.OK


@pytest.fixture(scope="module")
def go_controller(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Go example, built offline (standard library only) into a temp folder."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go is not installed (Debian: apt-get install golang-go)")
    out = tmp_path_factory.mktemp("go-controller")
    env = {
        **os.environ,
        "GOCACHE": str(out / "cache"),
        "GOPATH": str(out / "gopath"),
        "GOPROXY": "off",
        "GOFLAGS": "-mod=mod",
        "CGO_ENABLED": "0",
    }
    built = subprocess.run(
        [go, "build", "-o", str(out / "go-controller"), "."],
        cwd=GO_EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    return out / "go-controller"


def test_the_go_example_follows_a_run_branches_on_its_exit_code_and_takes_the_lock(
    engine: DockerClient, workflow: Path, go_controller: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "SANDBOX": str(Path(sys.executable).parent / "sandbox")}

    def controller(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(go_controller), *args], capture_output=True, text=True, env=env, timeout=300
        )

    done = controller("test", str(workflow), "step1")
    assert done.returncode == ExitCode.OK, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "event step_start step1"
    assert 'event action stub "upwork_submit_proposal"' in lines
    assert lines[-3] == "event step_end step1 passed"
    assert re.fullmatch(r"record test-\S+: passed", lines[-2]), lines[-2]
    assert lines[-1] == "result: step1 passed: the change can go on"

    missing = controller("test", str(tmp_path / "no-such-workflow"), "step1")
    assert missing.returncode == ExitCode.CONFIG, missing.stdout + missing.stderr
    assert missing.stdout.startswith("result: sandbox could not run it: config: workflow folder")

    # A normal run of the workflow under the shared lock keeps test runs out.
    normal = start_normal_run([str(go_controller), "normal", str(workflow)], ["--"], env)
    try:
        refused = controller("test", str(workflow), "step1")
        assert refused.returncode == ExitCode.REFUSED, refused.stdout + refused.stderr
        *_, record_line, result = refused.stdout.splitlines()
        assert record_line.endswith(": refused")
        assert result == "result: refused: a run holds the workflow; try again later"
        shared = controller("normal", str(workflow), "--", "true")
        assert shared.returncode == 0 and shared.stdout == "normal run exited 0\n", shared.stderr
    finally:
        out, err = normal.communicate("", timeout=60)
    assert normal.returncode == 5, err
    assert out == "normal run exited 5\n"
