"""A container's memory high-water mark, read on the host from the container's cgroup.

Why: under gVisor the step sees no cgroup files, and the executor's rusage is what the
sentry says about processes the step controls. The kernel's own accounting of the
container's cgroup (the sandbox's host processes, and every page the step's memory
uses) lives on the host, out of the step's reach.

How, and what it guarantees:
- The host process the engine names as the container's (`State.Pid`) is looked up in
  `/proc/<pid>/cgroup` once, right after the container started. The peak file's path is
  made only of what the kernel wrote there (no `..`, absolute), under `/sys/fs/cgroup`:
  cgroup v1 `memory/<path>/memory.max_usage_in_bytes`, or, on a pure v2 host,
  `<path>/memory.peak` (kernel 5.19+). cgroupfs holds no links a container could plant;
  the file is opened with O_NOFOLLOW all the same.
- The file is opened once and read again through that descriptor at every look, so a
  pid reused later, or a cgroup of the same name made later, is never read. Once the
  engine removed the cgroup, reads fail and the last figure stands.
- A high-water mark only rises: one look after an allocation sees it, however briefly
  the memory was held. What the step allocates after the last look before its
  container ends (one look interval, plus the time the sandbox takes to end) can be
  missed; the figure is then the highest mark seen.

Limits: the engine must run on this host (the Docker backend's bind mounts need that
too); an engine in another cgroup namespace than the runner's is not supported (the
path would be relative to it, and no file is found: no figure).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path, PurePosixPath

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_PEAK = "memory.max_usage_in_bytes"
V2_PEAK = "memory.peak"


def peak_file(pid: int, cgroup_root: Path = CGROUP_ROOT) -> Path | None:
    """The peak file of the memory cgroup that holds host process `pid`, or None."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return peak_file_of(text, cgroup_root)


def peak_file_of(text: str, cgroup_root: Path = CGROUP_ROOT) -> Path | None:
    """The peak file named by the text of a `/proc/<pid>/cgroup`, or None."""
    unified: Path | None = None
    for line in text.splitlines():
        hierarchy, sep, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep and sep2) or not path.startswith("/") or ".." in PurePosixPath(path).parts:
            continue
        relative = path.lstrip("/")
        if "memory" in controllers.split(","):
            return cgroup_root / "memory" / relative / V1_PEAK
        if hierarchy == "0" and controllers == "":
            unified = cgroup_root / relative / V2_PEAK
    # The unified line names the memory cgroup only when v2 is the only hierarchy.
    if unified is not None and (cgroup_root / "cgroup.controllers").exists():
        return unified
    return None


class PeakReader:
    """One open peak file; `read()` gives the mark now, or None once the cgroup is gone."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def open(cls, pid: int, cgroup_root: Path = CGROUP_ROOT) -> PeakReader | None:
        path = peak_file(pid, cgroup_root)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        return cls(fd)

    def read(self) -> int | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 32, 0).strip())
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
