"""The test cluster's keys and certificates, made fresh for every cluster.

One CA per cluster signs everything: etcd's serving and peer certificate, the
apiserver's client certificate to etcd, the apiserver's and the kubelet's serving
certificates (all for 127.0.0.1 only), and the apiserver's client certificate to the
kubelet, the only identity the kubelet accepts. The service-account signing key is
separate. Everything is P-256 (fast to make, accepted by every component) and written
0600 into the cluster's own folder; nothing outlives the folder.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class CertificateAuthority:
    """A throwaway CA whose certificates are valid for one day."""

    def __init__(self, directory: Path, common_name: str) -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        self.name = name
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.cert_path = directory / "ca.crt"
        _write(self.cert_path, self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        stem: str,
        common_name: str,
        *,
        organization: str | None = None,
        server: bool = False,
        client: bool = False,
        ip: str = "127.0.0.1",
    ) -> tuple[Path, Path]:
        """Write `<stem>.crt` and `<stem>.key`; a server certificate names `ip` (a
        loopback address) and localhost only."""
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        if organization:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        usages += [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if server:
            if not ipaddress.ip_address(ip).is_loopback:
                raise ValueError(f"{ip}: a test cluster's server certificate names loopback only")
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address(ip)), x509.DNSName("localhost")]
                ),
                critical=False,
            )
        cert = builder.sign(self.key, hashes.SHA256())
        crt, keyfile = self.directory / f"{stem}.crt", self.directory / f"{stem}.key"
        _write(crt, cert.public_bytes(serialization.Encoding.PEM))
        _write(keyfile, _key_pem(key))
        return crt, keyfile


def service_account_keys(directory: Path) -> tuple[Path, Path]:
    """The key pair the apiserver signs service-account tokens with (ES256)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / "sa.key", directory / "sa.pub"
    _write(private, _key_pem(key))
    _write(
        public,
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    )
    return private, public
