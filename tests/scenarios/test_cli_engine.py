"""The command line on bad input, gc after a killed runner, list/show, doctor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.contracts.record import RunStatus, read_record
from tests.conftest import WorkflowFactory, containers_of, tree_digest

pytestmark = pytest.mark.engine


def sandbox_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_run_prints_summary_and_exit_codes(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    ok = make_workflow("ok", command="echo hello")
    bad = make_workflow("bad", command="echo oops >&2; exit 4")
    done = sandbox_cli("run", str(ok), "step1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith("step step1 passed")
    assert "no action was stubbed" in done.stdout
    failed = sandbox_cli("run", str(bad), "step1", "--json")
    assert failed.returncode == 1
    (line,) = failed.stdout.splitlines()  # --json: one object, on one line
    record = json.loads(line)
    assert record["exit_code"] == 4 and "oops" in record["stderr"]["text"]

    listing = sandbox_cli("list", str(ok))
    assert listing.returncode == 0
    assert "[test run]  step1  passed" in listing.stdout
    run_dir = next((ok / "runs").glob("test-*"))
    shown = sandbox_cli("show", str(run_dir))
    assert shown.returncode == 0 and "step step1 passed" in shown.stdout


def test_show_names_a_submission_after_600_stubbed_calls_and_counts_601(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    """The stubbed list is grouped by tool: the one submission after 600 harmless
    stubbed calls is in the record and in `sandbox show`, and the headline counts all."""
    wf = make_workflow("spender", command="python3 /workflow/code/spend.py")
    (wf / "code" / "spend.py").write_text(
        textwrap.dedent(
            """\
            import agentworks_bridge as b
            for i in range(600):
                b.call("record_goal_observations", {"observations": [i]})
            b.call("upwork_submit_proposal", {"job_id": 42, "text": "hire me"})
            """
        )
    )
    done = sandbox_cli("run", str(wf), "step1")
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = next((wf / "runs").glob("test-*"))
    record = read_record(run_dir)
    assert record.actions.stub == 601
    assert [(g.tool, g.count) for g in record.stubbed] == [
        ("record_goal_observations", 600),
        ("upwork_submit_proposal", 1),
    ]
    shown = sandbox_cli("show", str(run_dir))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "601 call(s) were stubbed (would have run), 2 distinct tool(s):" in lines
    submit = [line for line in lines if line.startswith("  - upwork_submit_proposal x1: ")]
    assert len(submit) == 1 and "[job_id=42]" in submit[0], shown.stdout
    assert "  - 601 stubbed call(s) (record_goal_observations, upwork_submit_proposal)" in lines


@pytest.mark.parametrize(
    ("case", "expected", "code"),
    [
        ("missing workflow", "workflow folder not found", 4),
        ("unknown step", "unknown step 'nope'", 4),
        ("bad toml", "workflow.toml: steps[0].timeout_s", 4),
        ("engine down", "Docker engine not reachable", 5),
    ],
)
def test_bad_input_is_one_line_its_own_exit_code_and_no_folder(
    engine: DockerClient,
    make_workflow: WorkflowFactory,
    tmp_path: Path,
    case: str,
    expected: str,
    code: int,
) -> None:
    wf = make_workflow(command="true")
    args, env = [str(wf), "step1"], {}
    if case == "missing workflow":
        args[0] = str(tmp_path / "no-such-workflow")
    elif case == "unknown step":
        args[1] = "nope"
    elif case == "bad toml":
        text = (wf / "workflow.toml").read_text().replace("timeout_s = 60", 'timeout_s = "soon"')
        (wf / "workflow.toml").write_text(text)
    elif case == "engine down":
        env = {"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    done = sandbox_cli("run", *args, env=env)
    assert done.returncode == code, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert expected in done.stderr
    assert not (wf / "runs").exists()


def test_unreadable_db_leaves_only_a_record(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command="true", earlier_files={"x.txt": "x"})
    (wf / "db" / "db.sqlite").write_bytes(b"this is not a database at all" * 100)
    done = sandbox_cli("run", str(wf), "step1")
    assert done.returncode == 7, done.stdout + done.stderr  # the run ended `error`
    run_dir = next((wf / "runs").glob("test-*"))
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "test_mode.json",
        "test_mode_actions.jsonl",
    ]
    record = read_record(run_dir)
    assert record.status is RunStatus.ERROR and "DB" in record.reason


def test_killed_runner_is_cleaned_by_gc_and_the_next_run_works(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command="sleep 300", timeout_s=600, earlier_files={"in.txt": "x"})
    before = tree_digest(wf)
    runner = subprocess.Popen(
        [sys.executable, "-m", "sandbox.cli", "run", str(wf), "step1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not containers_of(engine, wf):
            assert time.monotonic() < deadline, "the step container never started"
            assert runner.poll() is None, "the runner exited early"
            time.sleep(0.05)
    finally:
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=30)
    run_dir = next((wf / "runs").glob("test-*"))
    assert read_record(run_dir).status is RunStatus.RUNNING

    gc = sandbox_cli("gc", str(wf))
    assert gc.returncode == 0, gc.stderr
    assert not containers_of(engine, wf, all=True)
    record = read_record(run_dir)
    assert record.status is RunStatus.KILLED
    assert tree_digest(wf) == before

    # The lock died with the runner: the next run starts.
    text = (wf / "workflow.toml").read_text().replace('"sleep 300"', '"true"')
    (wf / "workflow.toml").write_text(text)
    again = sandbox_cli("run", str(wf), "step1")
    assert again.returncode == 0, again.stdout + again.stderr


def test_sigterm_to_the_runner_records_killed_and_removes_containers(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    wf = make_workflow(command="sleep 300", timeout_s=600)
    runner = subprocess.Popen(
        [sys.executable, "-m", "sandbox.cli", "run", str(wf), "step1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not containers_of(engine, wf):
        assert time.monotonic() < deadline and runner.poll() is None
        time.sleep(0.05)
    runner.send_signal(signal.SIGTERM)
    out, err = runner.communicate(timeout=60)
    assert runner.returncode == 130, out + err  # interrupted
    record = read_record(next((wf / "runs").glob("test-*")))
    assert record.status is RunStatus.KILLED
    assert not containers_of(engine, wf, all=True)


def test_doctor_reports_a_healthy_host(engine: DockerClient) -> None:
    done = sandbox_cli("doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ok  ] seccomp profile" in done.stdout


def test_a_run_as_its_own_process_freezes_start_up_once_the_engine_is_connected(
    engine: DockerClient, make_workflow: WorkflowFactory
) -> None:
    # What `sandbox run` does as a process of its own (`main()` reading sys.argv): the
    # collector is off through the imports and on again for the run, with what start-up
    # made (the engine's client included) frozen; the run's own objects are not.
    wf = make_workflow(command="true")
    code = textwrap.dedent(
        f"""
        import contextlib, gc, io, json, sys
        sys.argv = ["sandbox", "run", {str(wf)!r}, "step1", "--json"]
        import sandbox.run.testrun as testrun
        seen = {{}}
        execute = testrun.TestRun.execute
        def spy(self):
            record = execute(self)
            seen["record"] = record
            return record
        testrun.TestRun.execute = spy
        from sandbox.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            exit_code = main()
        tracked = {{id(o) for o in gc.get_objects()}}  # the permanent generation is not listed
        from docker.api.client import APIClient
        print(json.dumps({{
            "exit_code": exit_code,
            "enabled": gc.isenabled(),
            "client_frozen": id(APIClient) not in tracked,
            "record_frozen": id(seen["record"]) not in tracked,
        }}))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout)
    assert state == {
        "exit_code": 0,
        "enabled": True,
        "client_frozen": True,
        "record_frozen": False,
    }
