"""Start a fake outside server in its own container on its own (IPv4+IPv6) network."""

from __future__ import annotations

import contextlib
import json
import secrets
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
from docker import DockerClient

SERVER = Path(__file__).resolve().parent / "outside_server.py"
ALIAS = "outside.test"


@dataclass(frozen=True)
class Outside:
    network: str
    ipv4: str
    ipv6: str

    def seen(self) -> list[dict[str, Any]]:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://{self.ipv4}:8080/__seen", timeout=10) as response:
            data: list[dict[str, Any]] = json.loads(response.read())
            return data


@contextlib.contextmanager
def outside_server(client: DockerClient) -> Iterator[Outside]:
    suffix = secrets.token_hex(4)
    subnet6 = f"fd{secrets.randbelow(256):02x}:{secrets.randbelow(65536):x}::/64"
    ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=subnet6)])
    network = client.networks.create(
        f"sandbox-fake-outside-{suffix}",
        driver="bridge",
        internal=True,
        enable_ipv6=True,
        ipam=ipam,
        labels={"sandbox.fake": "1"},
    )
    container = None
    try:
        container = client.containers.create(
            "sandbox-step:current",
            ["python3", "/srv/outside_server.py"],
            name=f"sandbox-fake-outside-{suffix}",
            user="10001:10001",
            labels={"sandbox.fake": "1"},
            mounts=[
                docker.types.Mount(
                    "/srv/outside_server.py", str(SERVER), type="bind", read_only=True
                )
            ],
            network=network.name,
            networking_config={network.name: client.api.create_endpoint_config(aliases=[ALIAS])},
            detach=True,
        )
        container.start()
        container.reload()
        net = container.attrs["NetworkSettings"]["Networks"][network.name]
        outside = Outside(network.name, net["IPAddress"], net["GlobalIPv6Address"])
        deadline = time.monotonic() + 30
        while True:
            try:
                outside.seen()
                break
            except OSError:
                assert time.monotonic() < deadline, "the fake outside server did not come up"
                time.sleep(0.05)
        yield outside
    finally:
        if container is not None:
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            network.remove()
