"""Run the fake job-board API as a real server in its own container and network.

Used by `make demo` and the tests: it is the outside world of the job-board
example (the bridge upstream). The network is created here, labelled
`sandbox.fake`, and removed on exit with the container; the host reaches the
server on the container's own address on that network, nothing else.
"""

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

from sandbox.contracts.names import STEP_IMAGE

SERVER = Path(__file__).resolve().parent / "server.py"
FAKE_LABEL = "sandbox.fake"
ALIAS = "jobboard"
PORT = 8080


@dataclass(frozen=True)
class FakeJobBoard:
    network: str
    address: str  # the container's IP on its network (host-reachable)

    @property
    def url(self) -> str:
        return f"http://{self.address}:{PORT}"

    def state(self) -> dict[str, Any]:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(self.url + "/state", timeout=10) as response:
            data: dict[str, Any] = json.loads(response.read())
            return data


def outside_world_lines(state: dict[str, Any]) -> list[str]:
    """What the fake job board saw, as the demos print it: every call it received and
    the effects it counted (a test run must leave all of them at zero)."""
    calls = ", ".join(c.get("tool", "?") for c in state["calls"])
    return [
        f"fake job-board API received {len(state['calls'])} call(s): {calls}",
        f"proposals submitted: {len(state['proposals'])}, messages sent: {len(state['messages'])}, "
        f"clicks: {len(state['clicks'])}, connects left: {state['connects']}",
    ]


@contextlib.contextmanager
def fake_jobboard(client: DockerClient, image: str = STEP_IMAGE) -> Iterator[FakeJobBoard]:
    suffix = secrets.token_hex(4)
    network = client.networks.create(
        f"sandbox-fake-{suffix}", driver="bridge", internal=True, labels={FAKE_LABEL: "1"}
    )
    container = None
    try:
        container = client.containers.create(
            image,
            ["python3", "/srv/server.py", "--host", "0.0.0.0", "--port", str(PORT)],
            name=f"sandbox-fake-jobboard-{suffix}",
            user="10001:10001",
            labels={FAKE_LABEL: "1"},
            mounts=[docker.types.Mount("/srv/server.py", str(SERVER), type="bind", read_only=True)],
            network=network.name,
            networking_config={network.name: client.api.create_endpoint_config(aliases=[ALIAS])},
            detach=True,
        )
        container.start()
        container.reload()
        address = container.attrs["NetworkSettings"]["Networks"][network.name]["IPAddress"]
        fake = FakeJobBoard(network=network.name, address=address)
        _wait_healthy(fake)
        yield fake
    finally:
        if container is not None:
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            network.remove()


def _wait_healthy(fake: FakeJobBoard, deadline_s: float = 30.0) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    end = time.monotonic() + deadline_s
    while True:
        try:
            with opener.open(fake.url + "/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > end:
                raise RuntimeError("the fake job-board API did not come up") from None
            time.sleep(0.05)
