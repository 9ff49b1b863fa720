"""The engine's user-namespace remapping, read from `docker info` (and `/etc/subuid`).

With `userns-remap` on, dockerd lists `name=userns` in `SecurityOptions` and keeps
the remapped root's images under `DockerRootDir` = `<data-root>/<uid>.<gid>`: the
host uid and gid of the containers' root, that is the base of the mapping. The size
of the range is not in `docker info`; it is the length of the subordinate range that
starts at that base in `/etc/subuid` (`/etc/subgid`), and Docker's default (65536)
when the runner cannot see the engine's files (an engine in its own mount namespace).
A wrong size can only refuse: every id the run uses (10001, 10002, 10100+) is far
below 65536, and `IdMap` raises for an id outside its range.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sandbox.contracts.errors import EngineError
from sandbox.contracts.ids import NO_REMAP, IdMap

DEFAULT_RANGE = 65536
SUBUID, SUBGID = Path("/etc/subuid"), Path("/etc/subgid")


def remapped(info: dict[str, Any]) -> bool:
    return any("name=userns" in str(opt) for opt in info.get("SecurityOptions") or ())


def id_map(info: dict[str, Any], subuid: Path = SUBUID, subgid: Path = SUBGID) -> IdMap:
    """The engine's mapping, or `EngineError` when it says it remaps but not how."""
    if not remapped(info):
        return NO_REMAP
    root_dir = str(info.get("DockerRootDir") or "")
    match = re.fullmatch(r"(\d+)\.(\d+)", Path(root_dir).name)
    if match is None:
        raise EngineError(
            f"the engine has userns-remap on, but its root folder {root_dir!r} does not "
            "name the remapped uid.gid; refusing to guess which host ids the run would get"
        )
    uid_base, gid_base = int(match[1]), int(match[2])
    size = min(_range_size(subuid, uid_base), _range_size(subgid, gid_base))
    return IdMap(uid_base=uid_base, gid_base=gid_base, size=size)


def _range_size(path: Path, base: int) -> int:
    """The length of the subordinate range starting at `base` (`name:start:count`)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return DEFAULT_RANGE
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() and int(parts[1]) == base:
            return int(parts[2])
    return DEFAULT_RANGE
