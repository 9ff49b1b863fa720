"""How the engine maps a container's user and group ids onto the host's.

An engine with user-namespace remapping (`userns-remap`) runs every container in a
user namespace whose id `k` is host id `base + k`: the step's uid 10001 is host uid
`base + 10001`. Host-side code that hands a folder or file to a container (the
step's disk, the guard's config and action log, an MCP server's socket folder)
must chown it to the host id, or the container cannot use it. Ids inside the
container (the `user=` of a spec, the firewall's `--uid-owner`, which is read in
the user namespace that owns the run's network namespace) stay as they are.

Guarantee: `host_uid`/`host_gid` never return an id outside the mapped range; an id
the engine does not map raises `ValueError` (fail closed: the file stays root's).
"""

from __future__ import annotations

from pydantic import BaseModel


class IdMap(BaseModel, frozen=True):
    """Container id `k` is host id `base + k` for `k < size`; no remapping when `size`
    is None (container id `k` is host id `k`)."""

    uid_base: int = 0
    gid_base: int = 0
    size: int | None = None

    @property
    def remapped(self) -> bool:
        return self.size is not None

    def host_uid(self, uid: int) -> int:
        return self._shift(uid, self.uid_base, "uid")

    def host_gid(self, gid: int) -> int:
        return self._shift(gid, self.gid_base, "gid")

    def _shift(self, value: int, base: int, kind: str) -> int:
        if self.size is None:
            return value
        if not 0 <= value < self.size:
            raise ValueError(
                f"container {kind} {value} is outside the engine's remapped range "
                f"({base}..{base + self.size - 1})"
            )
        return base + value

    def describe(self) -> str:
        if self.size is None:
            return "userns-remap off (container ids are host ids)"
        return (
            f"userns-remap on: container uid k is host uid {self.uid_base}+k, gid k is "
            f"host gid {self.gid_base}+k (k < {self.size})"
        )


NO_REMAP = IdMap()
