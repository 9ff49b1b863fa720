"""The step's Landlock wall: the executor restricts itself before the step exists.

Why: on a Pod the kubelet mounts a file of the node's disk into every container
(`/dev/termination-log`, mode 0666, read-write), so without a wall of its own a
hostile step could fill the node's disk; on Docker the same wall is a second one
behind the read-only root. Writes then go only beneath the step's group folder,
the DB copy's folder, /tmp and /dev/shm, and to a few harmless device nodes; reads
and execution stay allowed everywhere. Where the kernel can (ABI 6), signals and
abstract unix sockets may not leave the step either: a Pod's containers share
their network and IPC namespaces with the guard.

Run on the main thread before any thread starts (a Landlock domain binds the
calling thread and what it starts, not its siblings). Stdlib only, like the rest
of the step side.
"""

from __future__ import annotations

import importlib
import json
import os

from .interface import LANDLOCK_ENV, LANDLOCK_MARK, LANDLOCK_REFUSED_EXIT

# Not `typing.TYPE_CHECKING`: `typing` alone costs the executor's start-up ~10 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Final

# `require-scoped`: as `require`, and the wall must also keep abstract unix sockets
# and signals inside the step (ABI 6): a Pod with stdio MCP servers, whose
# containers share the step's network namespace (a server's abstract socket would
# otherwise be a way round the guard).
MODES: Final = ("require", "require-scoped", "apply")
SCOPES_NEEDED: Final = ("abstract_unix_socket", "signal")

WRITABLE_DIRS: Final = ("/tmp", "/dev/shm")
# Device nodes a shell or a terminal program writes or ioctls; /dev/pts as a folder.
WRITABLE_DEV: Final = tuple(
    f"/dev/{name}" for name in ("null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts")
)


def _landlock() -> ModuleType:
    """The `landlock` module beside this package: `sandbox.stepside.landlock` in the
    repository, the top-level `landlock` in the step image."""
    parent = (__package__ or "").rpartition(".")[0]
    return importlib.import_module(f"{parent}.landlock" if parent else "landlock")


def writable_paths(root: str) -> list[str]:
    """Where the step may write: its group folder, its DB copy's folder, scratch space."""
    paths = [root]
    db_path = os.environ.get("DB_PATH", "")
    if db_path:
        paths.append(os.path.dirname(os.path.abspath(db_path)))
    return [*paths, *WRITABLE_DIRS, *WRITABLE_DEV]


def gate(root: str) -> int | None:
    """Put the wall up as `$AGENTWORKS_LANDLOCK` asks and report it on stderr; returns
    LANDLOCK_REFUSED_EXIT when the wall is required and was not made (fail closed)."""
    mode = os.environ.pop(LANDLOCK_ENV, "").strip()
    if not mode:
        return None
    report: dict[str, object] = {
        "required": mode != "apply",
        "abi": None,
        "applied": False,
        "scoped": [],
        "reason": "",
    }
    if mode not in MODES:
        report["reason"] = f"{LANDLOCK_ENV}={mode!r} is neither 'require' nor 'apply'"
    else:
        landlock = _landlock()
        abi = int(landlock.abi_version())
        report["abi"] = abi or None
        try:
            _, scoped = landlock.restrict(writable_paths(root), abi=abi)
        except OSError as exc:
            report["reason"] = f"the kernel gave no Landlock wall: {exc.strerror or exc}"
        else:
            names: list[str] = landlock.scope_names(scoped)
            report["applied"] = True
            report["scoped"] = names
            missing = [n for n in SCOPES_NEEDED if n not in names]
            if mode == "require-scoped" and missing:
                report["reason"] = (
                    f"the kernel's Landlock (ABI {abi}) cannot scope {', '.join(missing)} "
                    "(ABI 6 can), and stdio MCP servers share the step's network namespace"
                )
    os.write(2, f"{LANDLOCK_MARK} {json.dumps(report)}\n".encode())
    if report["required"] and (not report["applied"] or report["reason"]):
        return LANDLOCK_REFUSED_EXIT
    return None
