"""The image build's host-side caches (`sandbox.backends.docker.images`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.backends.docker import images


def test_the_mcp_servers_cache_is_made_with_its_parent_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed wheel's build caches under the user's cache folder, which a fresh
    account does not have yet: the MCP servers' fetch makes every folder on the way."""
    listing = tmp_path / "mcp-servers.txt"
    listing.write_text("# no servers: nothing to fetch\n")
    monkeypatch.setattr(images, "_mcp_listing", lambda: listing)
    monkeypatch.setattr(images, "BUILD_DIR", tmp_path / "fresh-cache" / "sandbox")
    into = tmp_path / "context"
    into.mkdir()

    images._mcp_servers(into)

    assert images.mcp_servers_cache().is_dir()
    assert (into / "mcp-wheels" / "requirements.txt").read_text() == ""
    assert (into / "mcp-node" / "package.json").is_file()
