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

from sandbox.contracts.names import STEP_IMAGE

SERVER = Path(__file__).resolve().parent / "outside_server.py"
ALIAS = "outside.test"


@dataclass(frozen=True)
class Outside:
    network: str
    ipv4: str
    ipv6: str
    ca_pem: str  # the CA that signed the server's HTTPS certificate (port 8444)

    def seen(self) -> list[dict[str, Any]]:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://{self.ipv4}:8080/__seen", timeout=10) as response:
            data: list[dict[str, Any]] = json.loads(response.read())
            return data

    def raw(self) -> list[bytes]:
        """Every byte each connection to the raw servers (8082, 8445 TLS) brought."""
        import base64

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://{self.ipv4}:8080/__raw", timeout=10) as response:
            return [base64.b64decode(item) for item in json.loads(response.read())]


def tls_files(folder: Path, name: str = ALIAS) -> str:
    """A test CA and a server certificate for `name` signed by it; returns the CA PEM."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake outside CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (folder / "server.pem").write_bytes(
        cert.public_bytes(pem)
        + key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (folder / "server.pem").chmod(0o644)
    folder.chmod(0o755)
    return ca.public_bytes(pem).decode()


@contextlib.contextmanager
def outside_server(client: DockerClient) -> Iterator[Outside]:
    import tempfile

    tls_dir = Path(tempfile.mkdtemp(prefix="sandbox-fake-tls-"))
    ca_pem = tls_files(tls_dir)
    suffix = secrets.token_hex(4)
    subnet6 = f"fd{secrets.randbelow(256):02x}:{secrets.randbelow(65536):x}::/64"
    ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=subnet6)])
    network_name = f"sandbox-fake-outside-{suffix}"
    network = client.networks.create(
        network_name,
        driver="bridge",
        internal=True,
        enable_ipv6=True,
        ipam=ipam,
        labels={"sandbox.fake": "1"},
    )
    container = None
    try:
        container = client.containers.create(
            STEP_IMAGE,
            ["python3", "/srv/outside_server.py"],
            name=f"sandbox-fake-outside-{suffix}",
            user="10001:10001",
            labels={"sandbox.fake": "1"},
            mounts=[
                docker.types.Mount(
                    "/srv/outside_server.py", str(SERVER), type="bind", read_only=True
                ),
                docker.types.Mount("/srv/tls", str(tls_dir), type="bind", read_only=True),
            ],
            network=network_name,
            networking_config={network_name: client.api.create_endpoint_config(aliases=[ALIAS])},
            detach=True,
        )
        container.start()
        container.reload()
        net = container.attrs["NetworkSettings"]["Networks"][network_name]
        outside = Outside(network_name, net["IPAddress"], net["GlobalIPv6Address"], ca_pem)
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
        import shutil

        shutil.rmtree(tls_dir, ignore_errors=True)
