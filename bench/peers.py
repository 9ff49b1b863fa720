"""The proxies a user would pick instead of the guard, run beside it for the peer rows.

Squid (what agent firewalls such as gh-aw-firewall put in front of an agent) and
tinyproxy, both Debian's packages, in an image built here on top of the step
image (`bench/peers/`: apt installs them if the image lacks them; no registry
is needed). Each runs in a container of its own on the bench's network with
caching off and its access log on, as such a firewall runs it. Neither syncs
its log per request; neither does the guard in group commit (its default).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker.errors

from bench.common import BENCH_LABEL, Bench, address_on, wait_for
from sandbox.contracts.names import IMAGE_TAG, STEP_IMAGE

PEERS_DIR = Path(__file__).resolve().parent / "peers"
PEERS_IMAGE = f"sandbox-bench-peers:{IMAGE_TAG}"
INPUTS_LABEL = "sandbox.bench.inputs"


@dataclass(frozen=True)
class Peer:
    name: str
    command: tuple[str, ...]
    port: int


PEERS = (
    Peer("squid", ("squid", "-N", "-f", "/etc/squid/bench.conf"), 3128),
    Peer("tinyproxy", ("tinyproxy", "-d", "-c", "/etc/tinyproxy/bench.conf"), 8888),
)


def _inputs(b: Bench) -> str:
    digest = hashlib.sha256(str(b.client.images.get(STEP_IMAGE).id).encode())
    for path in sorted(PEERS_DIR.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def ensure_image(b: Bench) -> str:
    """The peers' image, built when it is missing or its inputs changed."""
    inputs = _inputs(b)
    with contextlib.suppress(docker.errors.ImageNotFound):
        if b.client.images.get(PEERS_IMAGE).labels.get(INPUTS_LABEL) == inputs:
            return PEERS_IMAGE
    b.say(f"peers: building {PEERS_IMAGE} (Squid and tinyproxy from apt)")
    b.client.images.build(
        path=str(PEERS_DIR),
        tag=PEERS_IMAGE,
        buildargs={"STEP_IMAGE": STEP_IMAGE},
        labels={INPUTS_LABEL: inputs},
        rm=True,
    )
    return PEERS_IMAGE


def _answers(proxy: str, url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
    try:
        with opener.open(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def running(b: Bench, network: str, probe_url: str) -> Iterator[dict[str, tuple[str, int]]]:
    """Each peer started on `network`, proxying `probe_url` already: name -> (address,
    port). The containers carry the bench's label and are removed on exit."""
    image = ensure_image(b)
    started = []
    try:
        found: dict[str, tuple[str, int]] = {}
        for peer in PEERS:
            container = b.client.containers.run(
                image,
                list(peer.command),
                user="0:0",  # both drop to their own unprivileged user
                network=network,
                labels={BENCH_LABEL: b.bench_id},
                nano_cpus=10**9,  # one CPU, like the guard
                detach=True,
            )
            started.append(container)
            address = address_on(b, str(container.id), network)
            proxy = f"http://{address}:{peer.port}"
            wait_for(
                f"{peer.name} to proxy", functools.partial(_answers, proxy, probe_url), 60, 0.1
            )
            found[peer.name] = (address, peer.port)
        yield found
    finally:
        for container in started:
            with contextlib.suppress(docker.errors.APIError):
                container.remove(force=True)
