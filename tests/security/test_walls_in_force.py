"""The shapes a third-party container audit checks, from inside the step, under every
wall the session runs with (`SANDBOX_TEST_WALL`, `make test-walls`), and proof that
the wall the session asked for is the one the run had.

An audit tool run as the step looks at: the capabilities it holds, whether a seccomp
filter is in force (a filter that is loaded but not applied, as under gVisor without
`--oci-seccomp`, lets `unshare(CLONE_NEWUSER)` through), and whether any engine
socket is within reach (the host's, and the one of the engine this run is on).
Without the last check a session whose wall silently fell away would pass every
other test of the battery on plain runc.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from docker import DockerClient

from testbed.engines.second_engine import SecondEngine
from tests.engines.fixtures import WALL_ENV
from tests.security.conftest import (
    Battery,
    assert_passed_without_trace,
    build_workflow,
    run_battery,
)

pytestmark = pytest.mark.engine

STEP = """
import stat

def status():
    fields = dict(l.split(":\\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\\t" in l)
    caps = {k: fields[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb") if k in fields}
    # gVisor's status has no NoNewPrivs or Seccomp line: prctl answers (39, 21).
    return {
        "caps": caps,
        "no_new_privs": int(fields.get("NoNewPrivs", LIBC.prctl(39, 0, 0, 0, 0))),
        "seccomp_mode": int(fields.get("Seccomp", LIBC.prctl(21, 0, 0, 0, 0))),
    }

attempt("audit: status", lambda: ("read", "", status()))
# In force, not merely loaded: the profile refuses a user namespace and ptrace.
attempt("audit: unshare(CLONE_NEWUSER)", lambda: in_child(lambda: sys_call(272, 0x10000000)))
attempt("audit: ptrace(PTRACE_TRACEME)", lambda: in_child(lambda: sys_call(101, 0, 0, 0, 0)))

def sockets():
    named = ["/var/run/docker.sock", "/run/docker.sock", "/run/containerd/containerd.sock",
             "@@ENGINE_SOCKET@@"]
    present = [p for p in named if os.path.lexists(p)]
    for top in ("/run", "/var/run", "/tmp", "/workflow", "/test", "/var/tmp"):
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                try:
                    if stat.S_ISSOCK(os.lstat(os.path.join(dirpath, name)).st_mode):
                        present.append(os.path.join(dirpath, name))
                except OSError:
                    pass
    return ("FOUND", "", present) if present else "none"

attempt("audit: engine sockets", sockets)
attempt("audit: kernel", lambda: ("read", "", {
    "release": os.uname().release,
    "uid_map": open("/proc/self/uid_map").read().split(),
}))
"""


def _engine_socket() -> str:
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    return host.removeprefix("unix://")


@pytest.fixture(scope="module")
def audit(engine: DockerClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Battery]:
    root = tmp_path_factory.mktemp("sec-audit")
    wf = build_workflow(root, STEP.replace("@@ENGINE_SOCKET@@", _engine_socket()))
    yield run_battery(engine, wf)


def _data(battery: Battery, name: str) -> Any:
    return battery.outcome(name).data


def test_the_run_passed_and_left_no_trace(audit: Battery) -> None:
    assert_passed_without_trace(audit)


def test_no_capability_and_no_new_privileges(audit: Battery) -> None:
    seen = _data(audit, "audit: status")
    assert set(seen["caps"].values()) == {"0000000000000000"}, seen
    assert seen["no_new_privs"] == 1, seen


def test_a_seccomp_filter_is_loaded_and_in_force(audit: Battery) -> None:
    seen = _data(audit, "audit: status")
    assert seen["seccomp_mode"] == 2, seen  # SECCOMP_MODE_FILTER
    for name in ("audit: unshare(CLONE_NEWUSER)", "audit: ptrace(PTRACE_TRACEME)"):
        got = audit.outcome(name)
        assert got.outcome == "EPERM", (name, got)


def test_no_engine_socket_is_within_reach(audit: Battery) -> None:
    got = audit.outcome("audit: engine sockets")
    assert got.outcome == "none", (got.outcome, got.data)


def test_the_run_had_the_wall_the_session_asked_for(
    audit: Battery, wall_engine: SecondEngine | None
) -> None:
    """The record says which walls the run had, and the kernel the step saw agrees:
    gVisor's sentry is not the host's kernel; under userns-remap the step's uid map
    starts at the engine's base."""
    wall = os.environ.get(WALL_ENV, "")
    walls = audit.record.walls
    kernel = _data(audit, "audit: kernel")
    gvisor = kernel["release"] != os.uname().release
    assert walls.step_runtime == ("runsc" if wall == "runsc" else "runc"), (wall, walls)
    assert gvisor is (wall == "runsc"), (wall, kernel)
    if wall == "userns":
        assert wall_engine is not None and wall_engine.remap is not None
        base = wall_engine.remap.outside
        assert (walls.userns_remap, walls.host_uid_base) == (True, base), walls
        assert kernel["uid_map"][:2] == ["0", str(base)], (kernel, base)
    else:
        assert not walls.userns_remap, walls
        if not gvisor:
            assert kernel["uid_map"][:2] == ["0", "0"], kernel


def test_every_audit_reported(audit: Battery) -> None:
    names = {n for n in audit.attempts if n.startswith("audit: ")}
    assert names == {
        "audit: status",
        "audit: unshare(CLONE_NEWUSER)",
        "audit: ptrace(PTRACE_TRACEME)",
        "audit: engine sockets",
        "audit: kernel",
    }, json.dumps(sorted(audit.attempts))
