"""`sandbox doctor`: this host's isolation posture, and the fix for each weakness.

Each check is independent and changes nothing. A check is one of three kinds:

- ok: nothing to do;
- a weakness (`ok=True, warn=True`): runs are still contained, but the host is weaker
  than it could be; the detail says why and what the fix is (on extra lines, because
  the CLI prints the `fix` field only for failures);
- a failure (`ok=False`): test runs would not be contained or would not start; the
  `fix` says what to do, and `sandbox doctor` exits 2.

What is measured, not assumed: the seccomp profile is loaded into a real container
(as the step's uid, on the step image) which then tries the syscalls the profile must
deny; the firewall's tools run in a fresh network namespace the way the run's init
container runs them (root, NET_ADMIN only).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

from pydantic import BaseModel

from sandbox.backends.docker import containers, images, runtimes, userns
from sandbox.backends.docker.client import (
    ENGINE_HINT,
    DockerClient,
    api_version,
    connect,
    engine_info,
)
from sandbox.contracts import names
from sandbox.contracts.errors import SandboxError
from sandbox.contracts.layout import GUARD_UID, STEP_UID
from sandbox.contracts.spec import ContainerSpec
from sandbox.launch.seccomp import step_profile


class Check(BaseModel):
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False  # ok, but weaker than it could be: `detail` says why and the fix


# The oldest Engine API the runner's containers need (cgroupns=private: API 1.41, Docker 20.10).
MIN_API = (1, 41)
# The first engine release whose built-in seccomp default denies io_uring (moby/moby#46762).
DEFAULT_PROFILE_DENIES_IO_URING = 25
PROBE_TIMEOUT_S = 60

MAX_USERNS = Path("/proc/sys/user/max_user_namespaces")
UNPRIVILEGED_USERNS = Path("/proc/sys/kernel/unprivileged_userns_clone")  # Debian/Ubuntu only

# Runs as the step (uid 10001, no capabilities) under seccomp/step.json; prints one
# JSON line.
# x86_64 syscall numbers; on another architecture the names it cannot try say "unknown".
SECCOMP_PROBE = r"""
import ctypes, errno, json, os, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
X86_64 = {"unshare": 272, "io_uring_setup": 425, "ptrace": 101}
NR = X86_64 if platform.machine() == "x86_64" else {}
# unshare(CLONE_NEWUSER); io_uring_setup(1, NULL): EFAULT if allowed; ptrace(PTRACE_PEEKDATA,
# self): ESRCH if allowed (not traced). The profile's denial is EPERM.
ARGS = {"unshare": (0x10000000,), "io_uring_setup": (1, 0), "ptrace": (2, os.getpid(), 0, 0)}
out = {}
for name, args in ARGS.items():
    if name not in NR:
        out[name] = "unknown"
        continue
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(NR[name]), *[ctypes.c_long(a) for a in args])
    out[name] = "allowed" if ret != -1 else errno.errorcode.get(ctypes.get_errno(), "?")
print(json.dumps(out))
"""
# What "denied by the profile" looks like: EPERM (the profile's defaultErrnoRet). Anything
# else (EFAULT, EINVAL, ESRCH: the kernel saw the call) means the call reached the kernel.
DENIED = "EPERM"

# Runs like the guard's entry script: root, NET_ADMIN, its own network namespace.
IPTABLES_PROBE = (
    "set -e; iptables -V; ip6tables -V; iptables -w -S OUTPUT >/dev/null; "
    "ip6tables -w -S OUTPUT >/dev/null; echo TABLES-READABLE"
)


def run_checks() -> list[Check]:
    try:
        client = connect(timeout_s=10)
    except SandboxError as exc:
        return [Check(name="engine", ok=False, detail=str(exc), fix=ENGINE_HINT)]
    info = engine_info(client)
    security = [str(opt) for opt in info.get("SecurityOptions") or []]
    checks = [
        _engine(client, info),
        _cgroups(info),
        _seccomp_support(security),
        _lsm(security),
    ]
    images_ok = True
    for ref in (names.STEP_IMAGE, names.GUARD_IMAGE, names.MCP_IMAGE):
        try:
            image_id = images.require(client, ref)
            checks.append(Check(name=f"image {ref}", ok=True, detail=image_id[:19]))
        except SandboxError as exc:
            images_ok = False
            checks.append(
                Check(name=f"image {ref}", ok=False, detail=str(exc), fix="run `make images`")
            )
    probe = _seccomp_probe(client) if images_ok else None
    checks.append(_seccomp_profile(probe, images_ok))
    checks.append(_user_namespaces(security, probe, info))
    checks.append(_run_iptables(client) if images_ok else _needs_images("iptables in the run"))
    checks.append(_step_disk())
    checks.append(_gvisor(info))
    iptables = shutil.which("iptables") is not None
    checks.append(
        Check(
            name="host iptables",
            ok=True,
            detail="present"
            if iptables
            else "absent (rules are installed inside the run's "
            "namespace by the guard's entry script, so the host needs none)",
        )
    )
    return checks


def _weak(name: str, facts: str, why: str, fix: str) -> Check:
    """A weakness: contained, but the host could do better."""
    return Check(
        name=name,
        ok=True,
        warn=True,
        detail=f"{facts}\n       weakness: {why}\n       fix: {fix}",
        fix=fix,
    )


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _engine(client: DockerClient, info: dict[str, object]) -> Check:
    server = str(info.get("ServerVersion") or "?")
    api = api_version(client)  # "0" for an engine too old for /version: treated as too old
    facts = f"Docker {server} (API {api})"
    if _version_tuple(api)[:2] < MIN_API:
        return Check(
            name="engine",
            ok=False,
            detail=f"{facts}: private cgroup namespaces need API {MIN_API[0]}.{MIN_API[1]}",
            fix="upgrade the engine to Docker 20.10 or newer",
        )
    major = (_version_tuple(server) or (0,))[0]
    if major < DEFAULT_PROFILE_DENIES_IO_URING:
        return _weak(
            "engine",
            facts,
            f"engines before {DEFAULT_PROFILE_DENIES_IO_URING}.0 ship a built-in seccomp "
            "default that allows io_uring (and ptrace/process_vm_* on kernels >= 4.8); steps "
            "and the guard (its root entry script included) run under seccomp/step.json "
            "regardless, but any other container on this engine uses the weaker default",
            f"upgrade to Docker Engine >= {DEFAULT_PROFILE_DENIES_IO_URING} (docker-ce)",
        )
    return Check(name="engine", ok=True, detail=facts)


def _cgroups(info: dict[str, object]) -> Check:
    version = str(info.get("CgroupVersion") or "?")
    driver = str(info.get("CgroupDriver") or "?")
    facts = f"cgroup v{version} (driver {driver}); every run has a private cgroup namespace"
    if version == "2":
        return Check(name="cgroups", ok=True, detail=facts)
    return _weak(
        "cgroups",
        facts,
        "cgroup v1 is the legacy hierarchy: the pids/memory/CPU limits hold, but buffered "
        "writes escape the I/O controller, the memory peak is v1's max_usage, and v1-only "
        "kernel paths such as release_agent (CVE-2022-0492) exist; steps cannot reach them "
        "(no capabilities, no mount or unshare)",
        "boot the host with the unified hierarchy (kernel command line "
        "systemd.unified_cgroup_hierarchy=1 cgroup_no_v1=all), then restart dockerd",
    )


def _seccomp_support(security: list[str]) -> Check:
    has_seccomp = any("seccomp" in opt for opt in security)
    return Check(
        name="seccomp support",
        ok=has_seccomp,
        detail="engine supports seccomp (" + ", ".join(o for o in security if "seccomp" in o) + ")"
        if has_seccomp
        else "engine has no seccomp: no step could be confined",
        fix="" if has_seccomp else "use a kernel and engine built with seccomp",
    )


def _lsm(security: list[str]) -> Check:
    found = [o for o in security if "apparmor" in o or "selinux" in o]
    if found:
        return Check(name="LSM", ok=True, detail=", ".join(found))
    return _weak(
        "LSM",
        "no AppArmor or SELinux confinement of containers",
        "a second, independent layer (file and mount rules per container) is missing; "
        "containment rests on capabilities, seccomp, namespaces and read-only mounts",
        "enable AppArmor (kernel command line apparmor=1 security=apparmor, apt-get "
        "install apparmor) and restart dockerd: it applies docker-default to every container",
    )


def _probe_spec(name: str, command: list[str], user: str, **kwargs: object) -> ContainerSpec:
    # Labelled with this process as its runner, as a run's containers are: a `sandbox gc`
    # elsewhere on the host leaves a live doctor's probe alone and removes a dead one's.
    from sandbox.launch.specs import runner_labels
    from sandbox.run.testrun import runner_info

    return ContainerSpec.model_validate(
        {
            "name": f"sandbox-doctor-{name}-{secrets.token_hex(3)}",
            "image": names.STEP_IMAGE,
            "command": command,
            "user": user,
            "labels": {
                names.LABEL_ROLE: "doctor",
                **runner_labels(runner_info()),
            },
            "memory_bytes": 128 * 1024**2,
            "pids": 32,
            **kwargs,
        }
    )


def _seccomp_probe(client: DockerClient) -> dict[str, str] | str:
    """What the probe saw per syscall, or why it could not run (a string)."""
    try:
        spec = _probe_spec(
            "seccomp",
            ["/usr/bin/python3", "-c", SECCOMP_PROBE],
            f"{STEP_UID}:{STEP_UID}",
            seccomp_profile=step_profile(),
        )
        code, output = containers.run_once(client, spec, timeout_s=PROBE_TIMEOUT_S)
    except SandboxError as exc:
        return str(exc)
    if code != 0:
        tail = " | ".join(output.strip().splitlines()[-2:])
        return f"the probe exited {code}: {tail}"
    try:
        result = json.loads(output.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return f"the probe printed no result: {output.strip()[-200:]}"
    if not isinstance(result, dict):
        return "the probe printed no result"
    return {str(k): str(v) for k, v in result.items()}


def _seccomp_profile(probe: dict[str, str] | str | None, images_ok: bool) -> Check:
    if not images_ok or probe is None:
        return _needs_images("seccomp profile")
    if isinstance(probe, str):
        return Check(
            name="seccomp profile",
            ok=False,
            detail=probe,
            fix="see seccomp/README.md; regenerate with `python -m sandbox.launch.seccomp_tighten`",
        )
    open_calls = sorted(k for k, v in probe.items() if v not in (DENIED, "unknown"))
    said = ", ".join(f"{k} {v}" for k, v in sorted(probe.items()))
    if open_calls:
        return Check(
            name="seccomp profile",
            ok=False,
            detail="seccomp/step.json loads, but a step can still call "
            f"{', '.join(open_calls)} ({said})",
            fix="regenerate the profile with `python -m sandbox.launch.seccomp_tighten` and "
            "check the engine applies it (docker-py security_opt 'seccomp=<json text>')",
        )
    if all(v == "unknown" for v in probe.values()):
        said = "the syscall probe knows x86_64 only"
    else:
        said = f"denied as the step: {said}"
    return Check(
        name="seccomp profile",
        ok=True,
        detail=f"seccomp/step.json loads and Python runs under it; {said}",
    )


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _user_namespaces(
    security: list[str], probe: dict[str, str] | str | None, info: dict[str, object]
) -> Check:
    max_ns = _read_int(MAX_USERNS)
    unpriv = _read_int(UNPRIVILEGED_USERNS)
    host = f"host max_user_namespaces={max_ns if max_ns is not None else 'unknown'}"
    if unpriv is not None:
        host += f", unprivileged_userns_clone={unpriv}"
    remap = any("name=userns" in opt for opt in security)
    rootless = any("name=rootless" in opt for opt in security)
    engine = "userns-remap on" if remap else "rootless engine" if rootless else "userns-remap off"
    if remap:
        try:
            ids = userns.id_map(info)
        except SandboxError as exc:
            return Check(
                name="user namespaces",
                ok=False,
                detail=f"{host}; {engine}; {exc}",
                fix="run dockerd with a data-root of its own for the remapped root "
                "(the engine names it <uid>.<gid>); the runner needs the host ids",
            )
        engine = (
            f"userns-remap on (step uid {STEP_UID} is host uid {ids.host_uid(STEP_UID)}, "
            f"guard uid {GUARD_UID} is host uid {ids.host_uid(GUARD_UID)}; the runner "
            "chowns the run's folders to these)"
        )
    step_verdict = probe.get("unshare") if isinstance(probe, dict) else None
    if step_verdict is not None and step_verdict not in (DENIED, "unknown"):
        return Check(
            name="user namespaces",
            ok=False,
            detail=f"{host}; {engine}; a step CAN create a user namespace "
            f"(unshare(CLONE_NEWUSER): {step_verdict})",
            fix="the step profile must deny unshare/clone namespace flags "
            "(sandbox/launch/seccomp_tighten.py); as a host-wide stopgap: "
            "sysctl -w user.max_user_namespaces=0",
        )
    facts = f"{host}; {engine}; " + (
        "steps cannot create one (unshare(CLONE_NEWUSER) denied: EPERM)"
        if step_verdict == DENIED
        else "not measured in a step (no probe)"
    )
    if remap or rootless:
        return Check(name="user namespaces", ok=True, detail=facts)
    return _weak(
        "user namespaces",
        facts,
        "uid 0 in a container is uid 0 on the host: the guard's entry script (root, "
        "NET_ADMIN, milliseconds) and anything that escaped a container would act as host root; "
        "steps run as uid 10001 with no capabilities",
        'enable userns-remap ("userns-remap": "default" in /etc/docker/daemon.json, restart '
        "dockerd); the runner reads the mapping from the engine and gives the step and "
        "the guard their folders under the mapped host ids",
    )


def _gvisor(info: dict[str, object]) -> Check:
    """Whether `step_runtime = "runsc"` can run here: runsc installed and registered in
    the engine with the arguments the run needs (sandbox.launch.runtime)."""
    name = "gVisor for the step (optional)"
    problem = runtimes.runsc_problem(info)
    if problem is None:
        return Check(
            name=name,
            ok=True,
            detail="runsc registered with --network=host --oci-seccomp: "
            '`[isolation] step_runtime = "runsc"` or `sandbox run --step-runtime runsc` work',
        )
    return _weak(name, problem, "steps can run only on runc here", runtimes.REGISTER_HINT)


def _run_iptables(client: DockerClient) -> Check:
    """The run's firewall is installed by the guard's entry script (iptables from the
    base both images share): try the tools in a fresh namespace."""
    name = "iptables in the run"
    try:
        spec = _probe_spec(
            "iptables", ["/bin/sh", "-c", IPTABLES_PROBE], "0:0", cap_add=["NET_ADMIN"]
        )
        code, output = containers.run_once(client, spec, timeout_s=PROBE_TIMEOUT_S)
    except SandboxError as exc:
        return Check(name=name, ok=False, detail=str(exc), fix="run `make images`")
    versions = [ln.strip() for ln in output.splitlines() if "tables v" in ln]
    if code == 0 and "TABLES-READABLE" in output and len(versions) == 2:
        return Check(
            name=name,
            ok=True,
            detail=f"{'; '.join(versions)} in {names.STEP_IMAGE}; OUTPUT chains readable in "
            "a fresh network namespace (IPv4 and IPv6)",
        )
    tail = " | ".join(output.strip().splitlines()[-2:])
    missing = "not found" in output
    return Check(
        name=name,
        ok=False,
        detail=f"the firewall's tools failed (exit {code}): {tail}",
        fix="rebuild the images (`make images`; images/step/packages.txt lists iptables)"
        if missing
        else "load the kernel's netfilter modules (modprobe nf_tables ip6_tables) or use a "
        "kernel with nf_tables and IPv6",
    )


def _step_disk() -> Check:
    """Each run's disk (a loop-mounted ext4 image) and view (an overlay) need root."""
    name = "step disk and view"
    missing = []
    if os.geteuid() != 0:
        missing.append("the runner is not root")
    if shutil.which("mkfs.ext4") is None:
        missing.append("mkfs.ext4 is absent")
    if not os.path.exists("/dev/loop-control"):
        missing.append("/dev/loop-control is absent")
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError:
        filesystems = ""
    for fs in ("ext4", "overlay", "tmpfs"):
        if fs not in filesystems:
            missing.append(f"the kernel lists no {fs} file system")
    if missing:
        return Check(
            name=name,
            ok=False,
            detail="; ".join(missing),
            fix="run sandbox as root on a host with loop devices, e2fsprogs (mkfs.ext4), "
            "and ext4 and overlay in the kernel",
        )
    return Check(name=name, ok=True, detail="root, mkfs.ext4, loop devices, ext4 and overlay")


def _needs_images(name: str) -> Check:
    return Check(
        name=name, ok=False, detail="not checked: the images are missing", fix="run `make images`"
    )
