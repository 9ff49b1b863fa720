"""The engine's user-namespace remapping, as the runner reads it (no engine needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.backends.docker import userns
from sandbox.contracts.errors import EngineError
from sandbox.contracts.ids import NO_REMAP, IdMap

REMAP_INFO = {
    "SecurityOptions": ["name=seccomp,profile=default", "name=userns"],
    "DockerRootDir": "/var/lib/docker/300000.300010",
}


def test_no_remap_keeps_ids() -> None:
    ids = userns.id_map({"SecurityOptions": ["name=seccomp,profile=default"]})
    assert ids == NO_REMAP and not ids.remapped
    assert (ids.host_uid(10001), ids.host_gid(10002)) == (10001, 10002)


def test_remap_base_from_the_engine_root_and_size_from_subuid(tmp_path: Path) -> None:
    subuid, subgid = tmp_path / "subuid", tmp_path / "subgid"
    subuid.write_text("alice:100000:65536\ndockremap:300000:20000\n")
    subgid.write_text("dockremap:300010:30000\n")
    ids = userns.id_map(REMAP_INFO, subuid, subgid)
    assert ids == IdMap(uid_base=300000, gid_base=300010, size=20000)
    assert ids.host_uid(10001) == 310001 and ids.host_gid(10002) == 310012
    with pytest.raises(ValueError, match="outside the engine's remapped range"):
        ids.host_uid(20000)


def test_remap_size_defaults_when_the_engine_files_are_not_visible(tmp_path: Path) -> None:
    ids = userns.id_map(REMAP_INFO, tmp_path / "none", tmp_path / "none")
    assert ids.size == userns.DEFAULT_RANGE and ids.host_uid(10100) == 310100


def test_remap_without_a_readable_root_dir_refuses() -> None:
    with pytest.raises(EngineError, match="refusing to guess"):
        userns.id_map({"SecurityOptions": ["name=userns"], "DockerRootDir": "/var/lib/docker"})
