"""Static checks of the step seccomp profile (seccomp/step.json). No Docker needed.

The profile is applied for real by the engine tests; here we check that it is
what sandbox/launch/seccomp_tighten.py generates from the pinned upstream default.json, and
evaluate its rules ourselves (with runc's semantics) for the properties the
sandbox relies on.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import paths

ROOT = paths.REPO
SECCOMP = ROOT / "seccomp"
DEFAULT = SECCOMP / "default.json"
STEP = SECCOMP / "step.json"
README = SECCOMP / "README.md"

Rule = dict[str, Any]

DENY_ACTIONS = {
    "SCMP_ACT_ERRNO",
    "SCMP_ACT_KILL",
    "SCMP_ACT_KILL_THREAD",
    "SCMP_ACT_KILL_PROCESS",
    "SCMP_ACT_TRAP",
}
KNOWN_ACTIONS = DENY_ACTIONS | {
    "SCMP_ACT_ALLOW",
    "SCMP_ACT_LOG",
    "SCMP_ACT_TRACE",
    "SCMP_ACT_NOTIFY",
}
KNOWN_OPS = {
    "SCMP_CMP_NE",
    "SCMP_CMP_LT",
    "SCMP_CMP_LE",
    "SCMP_CMP_EQ",
    "SCMP_CMP_GE",
    "SCMP_CMP_GT",
    "SCMP_CMP_MASKED_EQ",
}

# Must not be granted by any rule, whatever the container's capabilities.
REMOVED = [
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "process_madvise",
    "userfaultfd",
    "perf_event_open",
    "bpf",
    "keyctl",
    "add_key",
    "request_key",
    "unshare",
    "setns",
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "syslog",
    "acct",
    "swapon",
    "swapoff",
    "socketcall",
]

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_VSOCK = 1, 2, 10, 16, 17, 40
CLONE_NAMESPACE_FLAGS = 0x7E020000  # NEWNS|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWCGROUP
ENOSYS = 38


def load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def import_tighten() -> ModuleType:
    from sandbox.launch import seccomp_tighten

    return seccomp_tighten


@pytest.fixture(scope="module")
def step() -> dict[str, Any]:
    return load(STEP)


def granting(profile: dict[str, Any], name: str) -> list[Rule]:
    return [
        r for r in profile["syscalls"] if name in r["names"] and r["action"] not in DENY_ACTIONS
    ]


def cond_true(arg: dict[str, Any], value: int) -> bool:
    a = int(arg["value"])
    op = arg["op"]
    if op == "SCMP_CMP_MASKED_EQ":
        return (value & a) == int(arg.get("valueTwo", 0))
    return {
        "SCMP_CMP_EQ": value == a,
        "SCMP_CMP_NE": value != a,
        "SCMP_CMP_LT": value < a,
        "SCMP_CMP_LE": value <= a,
        "SCMP_CMP_GT": value > a,
        "SCMP_CMP_GE": value >= a,
    }[op]


def rule_matches(rule: Rule, args: tuple[int, ...]) -> bool:
    """runc semantics: conditions are ANDed, unless some argument index is
    compared more than once, in which case every condition becomes a rule of
    its own (ORed). See opencontainers/runc#2735."""
    conds = rule.get("args") or []
    if not conds:
        return True
    indexes = [int(c["index"]) for c in conds]
    results = [cond_true(c, args[int(c["index"])]) for c in conds]
    if len(set(indexes)) < len(indexes):
        return any(results)
    return all(results)


def socket_allowed(profile: dict[str, Any], family: int) -> bool:
    args = (family, 1, 0, 0, 0, 0)
    return any(rule_matches(r, args) for r in granting(profile, "socket"))


def test_step_json_is_generated_from_default_json() -> None:
    tighten = import_tighten()
    profile, _notes = tighten.tighten(tighten.load(DEFAULT))
    assert STEP.read_text(encoding="utf-8") == tighten.render_json(profile), (
        "seccomp/step.json is stale: run `python -m sandbox.launch.seccomp_tighten`"
    )


def test_tighten_check_cli_passes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox.launch.seccomp_tighten", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_default_json_is_the_pinned_upstream_copy() -> None:
    digest = hashlib.sha256(DEFAULT.read_bytes()).hexdigest()
    assert digest in README.read_text(encoding="utf-8"), (
        "default.json changed: record its upstream commit and sha256 in seccomp/README.md"
    )


def test_docker_schema_shape(step: dict[str, Any]) -> None:
    assert set(step) <= {
        "defaultAction",
        "defaultErrnoRet",
        "architectures",
        "archMap",
        "syscalls",
        "listenerPath",
        "listenerMetadata",
        "flags",
    }
    assert step["defaultAction"] == "SCMP_ACT_ERRNO"
    assert step["defaultErrnoRet"] == 1  # EPERM, as upstream
    assert isinstance(step["archMap"], list) and step["archMap"]
    for entry in step["archMap"]:
        assert entry["architecture"].startswith("SCMP_ARCH_")
        assert entry["subArchitectures"] is None or isinstance(entry["subArchitectures"], list)
    assert isinstance(step["syscalls"], list) and step["syscalls"]
    for rule in step["syscalls"]:
        assert "name" not in rule  # legacy single-name form
        names = rule["names"]
        assert isinstance(names, list) and names
        assert all(isinstance(n, str) and n for n in names)
        assert rule["action"] in KNOWN_ACTIONS
        if "errnoRet" in rule:
            assert isinstance(rule["errnoRet"], int) and rule["action"] == "SCMP_ACT_ERRNO"
        for cond in rule.get("args") or []:
            assert 0 <= cond["index"] <= 5
            assert isinstance(cond["value"], int) and 0 <= cond["value"] < 2**64
            assert cond["op"] in KNOWN_OPS
        for key in ("includes", "excludes"):
            assert set(rule.get(key) or {}) <= {"caps", "arches", "minKernel"}
        assert isinstance(rule.get("comment", ""), str)


def test_default_action_unchanged_from_upstream(step: dict[str, Any]) -> None:
    upstream = load(DEFAULT)
    assert step["defaultAction"] == upstream["defaultAction"]
    assert step["defaultErrnoRet"] == upstream["defaultErrnoRet"]


@pytest.mark.parametrize("name", REMOVED)
def test_removed_syscall_is_not_granted(step: dict[str, Any], name: str) -> None:
    assert granting(step, name) == []


def test_only_removes_never_adds(step: dict[str, Any]) -> None:
    def granted(profile: dict[str, Any]) -> set[str]:
        return {
            n for r in profile["syscalls"] if r["action"] not in DENY_ACTIONS for n in r["names"]
        }

    assert granted(step) <= granted(load(DEFAULT))


def test_no_capability_dependent_rules(step: dict[str, Any]) -> None:
    for rule in step["syscalls"]:
        assert "caps" not in (rule.get("includes") or {}), rule
        assert "caps" not in (rule.get("excludes") or {}), rule


def test_native_abi_only(step: dict[str, Any]) -> None:
    # int 0x80 / socketcall would bypass the socket family filter (see README).
    assert all(not e["subArchitectures"] for e in step["archMap"])


@pytest.mark.parametrize("family", [AF_UNIX, AF_INET, AF_INET6, AF_NETLINK])
def test_socket_needed_families_allowed(step: dict[str, Any], family: int) -> None:
    assert socket_allowed(step, family)


@pytest.mark.parametrize("family", [AF_PACKET, AF_VSOCK])
def test_socket_packet_and_vsock_denied(step: dict[str, Any], family: int) -> None:
    assert not socket_allowed(step, family)


@pytest.mark.parametrize("family", [AF_PACKET, AF_VSOCK, AF_INET])
@pytest.mark.parametrize("high", [1 << 32, 0xFFFFFFFF00000000])
def test_socket_rules_ignore_upper_bits(step: dict[str, Any], family: int, high: int) -> None:
    # The kernel truncates the family to int; seccomp compares all 64 bits.
    # No rule may accept a value the kernel would read as a denied family.
    assert not socket_allowed(step, high | family)


def test_socket_rules_are_single_condition(step: dict[str, Any]) -> None:
    # runc ORs repeated conditions on one argument, so never rely on them.
    for rule in granting(step, "socket"):
        assert rule["names"] == ["socket"]
        assert len(rule.get("args") or []) == 1, rule
        assert rule["args"][0]["index"] == 0
        assert rule["args"][0]["op"] in {"SCMP_CMP_EQ", "SCMP_CMP_LT"}
        assert not rule.get("includes") and not rule.get("excludes")


def test_runc_or_semantics_would_defeat_a_combined_rule() -> None:
    # Documents why tighten.py does not use one [!= 17, != 40] rule.
    naive = {
        "names": ["socket"],
        "action": "SCMP_ACT_ALLOW",
        "args": [
            {"index": 0, "value": AF_PACKET, "op": "SCMP_CMP_NE"},
            {"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_NE"},
        ],
    }
    assert socket_allowed({"syscalls": [naive]}, AF_VSOCK)


def test_clone3_always_enosys(step: dict[str, Any]) -> None:
    rules = [r for r in step["syscalls"] if "clone3" in r["names"]]
    assert rules, "clone3 needs an explicit ENOSYS rule (glibc falls back to clone on ENOSYS)"
    for rule in rules:
        assert rule["action"] == "SCMP_ACT_ERRNO"
        assert rule["errnoRet"] == ENOSYS
        assert not rule.get("includes") and not rule.get("excludes")


def test_clone_always_namespace_filtered(step: dict[str, Any]) -> None:
    rules = granting(step, "clone")
    assert rules
    for rule in rules:
        (cond,) = rule["args"]
        assert cond["op"] == "SCMP_CMP_MASKED_EQ"
        assert cond["value"] & CLONE_NAMESPACE_FLAGS == CLONE_NAMESPACE_FLAGS
        assert cond.get("valueTwo", 0) == 0


def test_personality_only_with_upstream_filter(step: dict[str, Any]) -> None:
    values = set()
    for rule in granting(step, "personality"):
        (cond,) = rule["args"]
        assert cond["op"] == "SCMP_CMP_EQ"
        values.add(cond["value"])
    assert values == {0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF}
