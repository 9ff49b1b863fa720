"""Loading the step's seccomp profile (built in `seccomp/`, see its README).

The Engine API takes the profile's JSON text, not a path. A missing or
malformed profile is an error, never a silent fall-back to the engine default.
"""

from __future__ import annotations

import json
from pathlib import Path

from sandbox.contracts.errors import ConfigError
from sandbox.resources import seccomp_dir

# Package data: found the same way in a checkout and in an installed wheel.
PROFILE_PATH: Path = seccomp_dir() / "step.json"


def step_profile(path: Path = PROFILE_PATH) -> str:
    """The compact JSON text of the step profile."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"seccomp profile {path} unusable: {exc}") from None
    if not isinstance(data, dict) or "defaultAction" not in data or "syscalls" not in data:
        raise ConfigError(f"seccomp profile {path} is not a Docker seccomp profile")
    return json.dumps(data, separators=(",", ":"))


# The profile as a node's runtime reads a `Localhost` profile file.
NODE_PROFILE_PATH: Path = seccomp_dir() / "step.oci.json"
NODE_ARCH = "amd64"
# Go's architecture names (what a rule's includes/excludes list) -> libseccomp's.
SCMP_ARCHES = {
    "amd64": "SCMP_ARCH_X86_64",
    "arm64": "SCMP_ARCH_AARCH64",
    "s390x": "SCMP_ARCH_S390X",
    "riscv64": "SCMP_ARCH_RISCV64",
    "loong64": "SCMP_ARCH_LOONGARCH64",
    "mips64": "SCMP_ARCH_MIPS64",
    "mips64le": "SCMP_ARCH_MIPSEL64",
}


def oci_profile(profile_text: str, goarch: str = NODE_ARCH) -> str:
    """The profile in the OCI runtime spec's form, for nodes of one architecture.

    A Kubernetes node's runtime may read a `Localhost` profile as an OCI
    `LinuxSeccomp` (containerd does: it decodes the file straight into that struct),
    which has no `archMap`, `includes` or `excludes`. Read that way, Docker's form
    loses every condition on a rule: a rule meant for another architecture applies
    to all (s390's `clone` rule tests argument 1 and would let `clone` make
    namespaces on x86_64). Here each rule is kept only where Docker would apply it on
    `goarch`, its conditions resolved away, and `architectures` lists the native one
    with its sub-architectures. A condition other than architectures raises (the step
    profile has none: it is the same everywhere)."""
    data = json.loads(profile_text)
    native = SCMP_ARCHES.get(goarch)
    entry = next((a for a in data.get("archMap") or [] if a.get("architecture") == native), None)
    if entry is None:
        raise ConfigError(f"the seccomp profile has no architecture for {goarch!r}")
    rules = []
    for rule in data["syscalls"]:
        includes, excludes = rule.get("includes") or {}, rule.get("excludes") or {}
        if set(includes) - {"arches"} or set(excludes) - {"arches"}:
            raise ConfigError(f"seccomp rule {rule['names']} has conditions beyond arches")
        if includes.get("arches") and goarch not in includes["arches"]:
            continue
        if goarch in (excludes.get("arches") or []):
            continue
        rules.append(
            {k: v for k, v in rule.items() if k not in ("includes", "excludes", "comment")}
        )
    oci = {
        "defaultAction": data["defaultAction"],
        **({"defaultErrnoRet": data["defaultErrnoRet"]} if "defaultErrnoRet" in data else {}),
        "architectures": [native, *(entry.get("subArchitectures") or [])],
        "syscalls": rules,
    }
    return json.dumps(oci, indent=1) + "\n"
