"""The step profile in the OCI form a Kubernetes node's runtime reads (pure: no engine)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sandbox.contracts.errors import ConfigError
from sandbox.launch.seccomp import NODE_PROFILE_PATH, PROFILE_PATH, oci_profile

CLONE_NAMESPACE_FLAGS = 0x7E020000


@pytest.fixture(scope="module")
def node() -> dict[str, Any]:
    return dict(json.loads(NODE_PROFILE_PATH.read_text()))


def test_committed_node_profile_is_generated_from_step_json() -> None:
    assert NODE_PROFILE_PATH.read_text() == oci_profile(PROFILE_PATH.read_text()), (
        "regenerate with: python -c 'from sandbox.launch.seccomp import *; "
        'open(str(NODE_PROFILE_PATH), "w").write(oci_profile(PROFILE_PATH.read_text()))\''
    )


def test_no_condition_an_oci_reader_would_drop(node: dict[str, Any]) -> None:
    """An OCI `LinuxSeccomp` has no archMap, includes or excludes: a reader drops them
    and applies the rule everywhere."""
    assert set(node) == {"defaultAction", "defaultErrnoRet", "architectures", "syscalls"}
    for rule in node["syscalls"]:
        assert set(rule) <= {"names", "action", "args", "errnoRet"}, rule


def test_native_architecture_only(node: dict[str, Any]) -> None:
    assert node["architectures"] == ["SCMP_ARCH_X86_64"]


def test_clone_may_never_make_a_namespace(node: dict[str, Any]) -> None:
    """Read as OCI, Docker's form keeps s390's clone rule, which tests argument 1 (the
    stack on x86_64, 0 for a fork): clone(CLONE_NEWUSER) would pass."""
    rules = [
        r for r in node["syscalls"] if "clone" in r["names"] and r["action"] != "SCMP_ACT_ERRNO"
    ]
    assert len(rules) == 1
    (cond,) = rules[0]["args"]
    assert cond["index"] == 0 and cond["op"] == "SCMP_CMP_MASKED_EQ"
    assert cond["value"] & CLONE_NAMESPACE_FLAGS == CLONE_NAMESPACE_FLAGS


def test_same_grants_as_docker_applies_on_x86_64(node: dict[str, Any]) -> None:
    step = json.loads(PROFILE_PATH.read_text())
    applies = [
        {k: v for k, v in r.items() if k not in ("includes", "excludes", "comment")}
        for r in step["syscalls"]
        if "amd64" in (r.get("includes") or {}).get("arches", ["amd64"])
        and "amd64" not in (r.get("excludes") or {}).get("arches", [])
    ]
    assert node["syscalls"] == applies
    names = {n for r in node["syscalls"] for n in r["names"]}
    assert "s390_runtime_instr" not in names and "arch_prctl" in names


def test_other_conditions_are_refused() -> None:
    profile = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "archMap": [{"architecture": "SCMP_ARCH_X86_64"}],
        "syscalls": [
            {"names": ["bpf"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_BPF"]}}
        ],
    }
    with pytest.raises(ConfigError, match="beyond arches"):
        oci_profile(json.dumps(profile))
    with pytest.raises(ConfigError, match="no architecture"):
        oci_profile(json.dumps({**profile, "syscalls": []}), "ppc64le")
