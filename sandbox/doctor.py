"""`sandbox doctor`: is this host able to run hardened test runs, and if not, the fix.

Each check is independent and reports a fix; the doctor changes nothing.
"""

from __future__ import annotations

import shutil

from pydantic import BaseModel

from sandbox.engine import containers, images
from sandbox.engine.client import ENGINE_HINT, connect
from sandbox.errors import SandboxError
from sandbox.seccomp import step_profile
from sandbox.spec import ContainerSpec


class Check(BaseModel):
    name: str
    ok: bool
    detail: str
    fix: str = ""


def run_checks() -> list[Check]:
    checks: list[Check] = []
    try:
        client = connect(timeout_s=10)
    except SandboxError as exc:
        return [Check(name="engine", ok=False, detail=str(exc), fix=ENGINE_HINT)]
    info = client.info()
    checks.append(
        Check(
            name="engine",
            ok=True,
            detail=f"Docker {info.get('ServerVersion')}, cgroup v{info.get('CgroupVersion', '?')}, "
            f"security options: {', '.join(info.get('SecurityOptions') or []) or 'none'}",
        )
    )
    has_seccomp = any("seccomp" in opt for opt in info.get("SecurityOptions") or [])
    checks.append(
        Check(
            name="seccomp support",
            ok=has_seccomp,
            detail="engine supports seccomp" if has_seccomp else "engine has no seccomp",
            fix="" if has_seccomp else "use a kernel and engine built with seccomp",
        )
    )
    for ref in (images.STEP_IMAGE, images.GUARD_IMAGE):
        try:
            image_id = images.require(client, ref)
            checks.append(Check(name=f"image {ref}", ok=True, detail=image_id[:19]))
        except SandboxError as exc:
            checks.append(
                Check(name=f"image {ref}", ok=False, detail=str(exc), fix="run `make images`")
            )
    checks.append(_seccomp_loads(client))
    iptables = shutil.which("iptables") is not None
    checks.append(
        Check(
            name="host iptables",
            ok=True,
            detail="present"
            if iptables
            else "absent (rules are installed inside the run's "
            "namespace by an init container, so the host needs none)",
        )
    )
    return checks


def _seccomp_loads(client: object) -> Check:
    from docker import DockerClient

    assert isinstance(client, DockerClient)
    try:
        profile = step_profile()
        spec = ContainerSpec(
            name="sandbox-doctor-seccomp",
            image=images.STEP_IMAGE,
            command=["/usr/bin/python3", "-c", "print('ok')"],
            user="10001:10001",
            seccomp_profile=profile,
            labels={containers.LABEL_ROLE: "doctor"},
        )
        container = containers.create(client, spec)
        try:
            container.start()
            code = containers.wait(container, 60)
        finally:
            containers.remove(container)
    except SandboxError as exc:
        return Check(name="seccomp profile", ok=False, detail=str(exc), fix="see seccomp/README.md")
    ok = code == 0
    return Check(
        name="seccomp profile",
        ok=ok,
        detail="seccomp/step.json loads and Python runs under it" if ok else f"exit {code}",
        fix="" if ok else "regenerate with `python seccomp/tighten.py`",
    )
