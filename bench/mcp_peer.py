"""mcp-proxy (PyPI), the MCP peer: what a user would put in front of a stdio MCP server
to reach it over streamable HTTP instead of the guard.

It runs in a container of the bench's own, built here on top of the MCP image (the
same stdio servers the guard's runs use) with mcp-proxy in a venv of its own: it
needs the 1.x SDK, the servers' venv has 2.x. Its wheels are built on the host with
pip (cached in `build/` by the pinned version) and installed with no index, as the
MCP image's servers are: the engine reaches no registry. The proxy starts the server
as its child over stdio and serves `/mcp` (JSON replies, sessions), as the guard's
endpoint does; no policy, no log, no live lookup.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker.errors

from bench.common import BENCH_LABEL, MIB, Bench
from sandbox.backends.docker.images import BUILD_DIR, _pip
from sandbox.contracts.names import IMAGE_TAG, MCP_IMAGE

MCP_PROXY_REQUIREMENT = "mcp-proxy==0.13.0"
MCP_PROXY_DIR = Path(__file__).resolve().parent / "mcp_peer"
MCP_PROXY_IMAGE = f"sandbox-bench-mcp-proxy:{IMAGE_TAG}"
MCP_PROXY_PORT = 8096
INPUTS_LABEL = "sandbox.bench.inputs"


def _inputs(b: Bench) -> str:
    digest = hashlib.sha256(str(b.client.images.get(MCP_IMAGE).id).encode())
    digest.update(MCP_PROXY_REQUIREMENT.encode() + b"\0")
    digest.update((MCP_PROXY_DIR / "Dockerfile").read_bytes())
    return digest.hexdigest()[:16]


def _wheels(into: Path) -> None:
    """mcp-proxy's wheels and a requirements.txt, built on the host once per version."""
    key = hashlib.sha256(MCP_PROXY_REQUIREMENT.encode()).hexdigest()[:12]
    cache = BUILD_DIR / f"bench-mcp-proxy-{key}"
    if not cache.is_dir():
        BUILD_DIR.mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=BUILD_DIR))
        _pip(["wheel", "--quiet", "--wheel-dir", str(tmp), MCP_PROXY_REQUIREMENT])
        (tmp / "requirements.txt").write_text(MCP_PROXY_REQUIREMENT + "\n")
        tmp.rename(cache)
    shutil.copytree(cache, into)


def ensure_image(b: Bench) -> str:
    """mcp-proxy's image, built when it is missing or its inputs changed."""
    inputs = _inputs(b)
    with contextlib.suppress(docker.errors.ImageNotFound):
        if b.client.images.get(MCP_PROXY_IMAGE).labels.get(INPUTS_LABEL) == inputs:
            return MCP_PROXY_IMAGE
    b.say(f"mcp peer: building {MCP_PROXY_IMAGE} ({MCP_PROXY_REQUIREMENT}, wheels from the host)")
    with tempfile.TemporaryDirectory(prefix="sandbox-bench-mcp-proxy-") as tmp:
        context = Path(tmp)
        shutil.copy2(MCP_PROXY_DIR / "Dockerfile", context / "Dockerfile")
        _wheels(context / "wheels")
        b.client.images.build(
            path=str(context),
            tag=MCP_PROXY_IMAGE,
            buildargs={"MCP_IMAGE": MCP_IMAGE},
            labels={INPUTS_LABEL: inputs},
            rm=True,
            pull=False,
        )
    return MCP_PROXY_IMAGE


@contextlib.contextmanager
def running(b: Bench, server_command: list[str], network: str | None = None) -> Iterator[str]:
    """mcp-proxy serving `server_command` (a stdio server of the MCP image) at
    MCP_PROXY_PORT/mcp: on 127.0.0.1 inside a container with no network but loopback (a
    client joins its namespace), or with `network` on that network (a streamable-HTTP
    server a workflow names by its address); yields the container's id. Two CPUs: one
    for the proxy and one for its server, as the guard and its server container each get
    one."""
    image = ensure_image(b)
    where: dict[str, Any] = {"network": network} if network else {"network_mode": "none"}
    container = b.client.containers.run(
        image,
        ["/opt/mcp-proxy/bin/mcp-proxy", "--host", "0.0.0.0" if network else "127.0.0.1",
         "--port", str(MCP_PROXY_PORT), "--", *server_command],
        environment={"HOME": "/tmp"},
        **where,
        labels={BENCH_LABEL: b.bench_id},
        nano_cpus=2 * 10**9,
        mem_limit=512 * MIB,
        detach=True,
    )  # fmt: skip
    try:
        yield str(container.id)
    finally:
        with contextlib.suppress(docker.errors.APIError):
            container.remove(force=True)
