"""The two second walls work in a second engine, with plain containers of our images.

gVisor: a step-image container under `runsc-host-sc` (passthrough network, the OCI
seccomp profile applied) joins the network namespace of a runc container and reaches
its loopback port, as the step will reach its guard. userns-remap: the engine reports
the remapping, and a container's uid 10001 is host uid base + 10001.
Opt-in (`-m second_engine`, `make test-walls`): each engine costs a start and an image
load (see tests/engines/README.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker.errors
import pytest
from docker.models.containers import Container

from sandbox.contracts.names import STEP_IMAGE
from testbed.engines.engine_config import RUN_IMAGES, EngineConfig, id_map, read_remap
from testbed.engines.second_engine import EnginePool, SecondEngine

pytestmark = pytest.mark.second_engine

PORT = 8790
OWNER = f"""
import os, socket
s = socket.socket()
s.bind(("127.0.0.1", {PORT}))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(os.environ["TOKEN"].encode())
    c.close()
"""
CLIENT = f"""
import os, socket
print(os.uname().release)
try:
    with socket.create_connection(("127.0.0.1", {PORT}), timeout=10) as s:
        print("got", s.recv(100).decode())
except OSError as exc:
    print("error", type(exc).__name__)
"""
STEP_SHAPE: dict[str, Any] = {
    "user": "10001:10001",
    "cap_drop": ["ALL"],
    "security_opt": ["no-new-privileges"],
    "read_only": True,
}


def _wait_for_log(container: Container, text: str, deadline_s: float = 60) -> None:
    end = time.monotonic() + deadline_s
    while text not in container.logs().decode(errors="replace"):
        container.reload()
        assert container.status == "running", container.logs().decode(errors="replace")
        assert time.monotonic() < end, f"{text!r} never appeared in the logs"
        time.sleep(0.05)


def _run_to_end(engine: SecondEngine, **kwargs: Any) -> tuple[int, str, Container]:
    container = engine.client.containers.run(STEP_IMAGE, detach=True, **kwargs)
    status = container.wait(timeout=120)
    return status["StatusCode"], container.logs().decode(errors="replace"), container


@pytest.fixture(scope="module")
def runsc(second_engines: EnginePool) -> SecondEngine:
    return second_engines.get(EngineConfig.runsc(), images=(STEP_IMAGE,))


@pytest.fixture(scope="module")
def userns(second_engines: EnginePool) -> SecondEngine:
    return second_engines.get(EngineConfig.userns(), images=(STEP_IMAGE,))


@pytest.fixture
def cleanup(request: pytest.FixtureRequest) -> Iterator[list[Container]]:
    made: list[Container] = []
    yield made
    for container in made:
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)


def test_runsc_step_reaches_the_loopback_of_the_namespace_it_joins(
    runsc: SecondEngine, cleanup: list[Container]
) -> None:
    token = secrets.token_hex(8)
    owner = runsc.client.containers.run(
        STEP_IMAGE,
        ["python3", "-c", OWNER],
        detach=True,
        network_mode="none",
        environment={"TOKEN": token},
        **STEP_SHAPE,
    )
    cleanup.append(owner)
    _wait_for_log(owner, "listening")
    code, out, joined = _run_to_end(
        runsc,
        command=["python3", "-c", CLIENT],
        runtime="runsc-host-sc",
        network_mode=f"container:{owner.id}",
        **STEP_SHAPE,
    )
    cleanup.append(joined)
    assert code == 0, out
    assert joined.attrs["HostConfig"]["Runtime"] == "runsc-host-sc"
    release, reply = out.split("\n")[:2]
    assert release != os.uname().release, "the container saw the host kernel, not gVisor's"
    assert reply == f"got {token}"
    # The same container in a namespace of its own finds nothing there.
    code, out, alone = _run_to_end(
        runsc,
        command=["python3", "-c", CLIENT],
        runtime="runsc-host-sc",
        network_mode="none",
        **STEP_SHAPE,
    )
    cleanup.append(alone)
    assert code == 0 and out.split("\n")[1] == "error ConnectionRefusedError", out


def test_userns_remap_puts_container_uid_10001_at_base_plus_10001(
    userns: SecondEngine, cleanup: list[Container]
) -> None:
    assert userns.remap is not None
    base = userns.remap.outside
    info = userns.client.info()
    assert "name=userns" in " ".join(info["SecurityOptions"])
    assert read_remap(info) == (base, base)
    container = userns.client.containers.run(
        STEP_IMAGE, ["sleep", "600"], detach=True, network_mode="none", **STEP_SHAPE
    )
    cleanup.append(container)
    container.reload()
    pid = container.attrs["State"]["Pid"]
    status = dict(
        line.split(":", 1)
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ":" in line
    )
    assert status["Uid"].split() == [str(base + 10001)] * 4
    assert status["Gid"].split() == [str(base + 10001)] * 4
    (uid_range,) = id_map(pid)
    assert (uid_range.inside, uid_range.outside, uid_range.count) == (0, base, 65536)
    assert uid_range.host_id(10001) == base + 10001
    # The remap's own files never reached the host.
    assert str(base) not in Path("/etc/subuid").read_text() + Path("/etc/subgid").read_text()


PREFLIGHT = """
import json
from agentworks_exec import preflight
print(json.dumps(preflight.run({})))
"""


@pytest.mark.parametrize(
    ("runtime_name", "in_force"), [("runsc", True), ("runsc-host", False)], ids=["oci", "ignored"]
)
def test_the_preflight_tells_whether_the_seccomp_profile_is_in_force_under_runsc(
    runsc: SecondEngine, cleanup: list[Container], runtime_name: str, in_force: bool
) -> None:
    """`runsc-host` lacks --oci-seccomp: the sentry ignores the profile and emulates
    unshare, so the preflight finds a way out and the step would never start."""
    from sandbox.launch import runtime as step_runtime
    from sandbox.launch.seccomp import step_profile

    profile = step_runtime.profile_for("runsc", step_profile())
    code, out, container = _run_to_end(
        runsc,
        command=["python3", "-c", PREFLIGHT],
        runtime=runtime_name,
        network_mode="none",
        security_opt=["no-new-privileges", f"seccomp={profile}"],
        pids_limit=step_runtime.PIDS_FLOOR,
        **{k: v for k, v in STEP_SHAPE.items() if k != "security_opt"},
    )
    cleanup.append(container)
    assert code == 0, out
    report = json.loads(out.strip().splitlines()[-1])
    opened = [line for line in report["open"] if line.startswith("user namespace")]
    assert bool(opened) is not in_force, report


def test_a_test_run_with_the_step_under_gvisor_passes_and_keeps_the_guard_on_runc(
    runsc: SecondEngine, tmp_path: Path
) -> None:
    from sandbox.contracts.record import RunStatus
    from sandbox.run.testrun import RunOptions, TestRun
    from tests.conftest import tree_digest, write_workflow

    runsc.load_images(*RUN_IMAGES)
    wf = write_workflow(
        tmp_path,
        command=["python3", "/workflow/code/step.py"],
        earlier_files={"in.txt": "41"},
    )
    (wf / "code" / "step.py").write_text(
        "import os, sqlite3, threading, pathlib\n"
        "n = int(pathlib.Path('in.txt').read_text())\n"
        "pathlib.Path('out.txt').write_text(str(n + 1))\n"
        "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
        "db = sqlite3.connect(os.environ['DB_PATH'])\n"
        "db.execute(\"INSERT INTO t VALUES (2, 'two')\"); db.commit()\n"
        "print('KERNEL', os.uname().release, 'UID', os.getuid())\n"
        # A tool the guard hands to the step's executor (the server thread's wait).
        "import agentworks_bridge\n"
        "listed = agentworks_bridge.call('list_dir', {'path': '.'})\n"
        "print('LISTED', listed.get('ok'), 'in.txt' in str(listed.get('result')))\n"
    )
    before = tree_digest(wf)
    saved = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = runsc.url
    try:
        record = TestRun(wf, "step1", RunOptions(step_runtime="runsc")).execute()
    finally:
        if saved is None:
            os.environ.pop("DOCKER_HOST")
        else:
            os.environ["DOCKER_HOST"] = saved
    assert record.status is RunStatus.PASSED, (record.reason, record.stderr.text[-800:])
    assert record.walls.step_runtime == "runsc"
    assert f"KERNEL {os.uname().release}" not in record.stdout.text, "the step saw the host kernel"
    assert "UID 10001" in record.stdout.text
    assert "LISTED True True" in record.stdout.text, record.stdout.text[-800:]
    assert record.preflight is not None and record.preflight.ok
    assert record.preflight.firewall_verified  # the guard (runc) installed and read back its rules
    assert "user namespace (seccomp in force)" in record.preflight.checks
    assert record.files.created == ["out.txt"]
    assert record.db_diff is not None
    assert {t.name: t.inserted for t in record.db_diff.tables}["t"] == 1
    assert tree_digest(wf) == before


def _doctor(engine: SecondEngine) -> str:
    import subprocess
    import sys

    engine.load_images(*RUN_IMAGES)
    done = subprocess.run(
        [sys.executable, "-m", "sandbox.cli", "doctor"],
        capture_output=True,
        text=True,
        timeout=300,
        env=engine.env(),
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_doctor_reports_the_remapping_with_the_host_ids(userns: SecondEngine) -> None:
    assert userns.remap is not None
    base = userns.remap.outside
    out = _doctor(userns)
    assert f"step uid 10001 is host uid {base + 10001}" in out, out
    assert f"guard uid 10002 is host uid {base + 10002}" in out, out


def test_doctor_finds_runsc_registered_as_the_run_needs_it(runsc: SecondEngine) -> None:
    out = _doctor(runsc)
    line = next(ln for ln in out.splitlines() if "gVisor for the step" in ln)
    assert line.startswith("[ok  ]") and "--network=host --oci-seccomp" in line, out


def test_a_fork_bomb_under_gvisor_ends_the_sandbox_and_the_record_says_so(
    runsc: SecondEngine, tmp_path: Path
) -> None:
    """The ptrace platform counts the sentry's host processes in the pids limit: past
    it the whole sandbox ends (exit 2), where runc gives the step EAGAIN. Contained all
    the same: the run is `failed`, the real workflow unchanged, no container left."""
    from sandbox.contracts.names import LABEL_RUN_ID
    from sandbox.contracts.record import RunStatus
    from sandbox.run.testrun import RunOptions, TestRun
    from tests.conftest import tree_digest, write_workflow

    runsc.load_images(*RUN_IMAGES)
    wf = write_workflow(tmp_path, command=["python3", "/workflow/code/step.py"])
    (wf / "code" / "step.py").write_text(
        "import os, time\n"
        "kids = []\n"
        "for _ in range(2000):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        print('EAGAIN after', len(kids)); break\n"
        "    if pid == 0:\n"
        "        time.sleep(30); os._exit(0)\n"
        "    kids.append(pid)\n"
    )
    before = tree_digest(wf)
    saved = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = runsc.url
    try:
        record = TestRun(wf, "step1", RunOptions(step_runtime="runsc")).execute()
    finally:
        if saved is None:
            os.environ.pop("DOCKER_HOST")
        else:
            os.environ["DOCKER_HOST"] = saved
    assert record.status is RunStatus.FAILED, (record.status, record.reason)
    assert record.walls.step_runtime == "runsc"
    assert tree_digest(wf) == before
    left = runsc.client.containers.list(all=True, filters={"label": f"{LABEL_RUN_ID}={record.id}"})
    assert left == []


def test_every_call_the_runsc_profile_names_is_one_the_sentry_knows_by_that_name() -> None:
    """runsc drops a profile name its sentry's table does not know, silently: the call
    then gets the profile's default EPERM (`pselect6`, 270 in the table as `pselect`,
    left `select.select` failing and every executor-routed tool call hanging). Each
    Linux x86_64 call the profile names must be in the installed runsc's table under
    one of the names its rule gives."""
    import re
    import subprocess

    from sandbox.launch import runtime as step_runtime
    from sandbox.launch.seccomp import step_profile

    listing = subprocess.run(
        ["runsc", "help", "syscalls"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    table = listing.split("linux/amd64:", 1)[1].split("linux/arm64:", 1)[0]
    sentry = {
        int(number): name
        for number, name in re.findall(r"^(\d+)\s+(\S+)", table, flags=re.MULTILINE)
    }
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h").read_text()
    linux = {name: int(n) for name, n in re.findall(r"#define __NR_(\w+)\s+(\d+)", header)}
    assert sentry and linux
    unknown = []
    for rule in json.loads(step_runtime.profile_for("runsc", step_profile()))["syscalls"]:
        for name in rule["names"]:
            number = linux.get(name)
            if number in sentry and sentry[number] not in rule["names"]:
                unknown.append(f"{name} ({number}: {sentry[number]} in the sentry)")
    assert not unknown, unknown
