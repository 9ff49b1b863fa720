"""TLS inspection for the egress proxy: a certificate authority made for one run only.

With `egress.inspect_tls = true` the guard makes a CA when it starts; its key
lives only in the guard process's memory (never on disk, never in the step's
container) and dies with the run. The CA's certificate is written to the
guard's folder; the runner copies it into the step's trust (CA bundle and the
usual environment variables). For an allowed CONNECT the proxy then terminates
TLS with a leaf certificate for that host, sees the request inside, and applies
the same method rules as plain HTTP; allowed requests go on over a verified TLS
connection to the real host.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_FILE = "egress-ca.pem"
VALID = datetime.timedelta(days=2)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


@dataclass
class RunCA:
    """One run's CA: `context_for(host)` gives a server-side TLS context for that host."""

    run_id: str
    _key: ec.EllipticCurvePrivateKey = field(init=False, repr=False)
    cert: x509.Certificate = field(init=False)
    _contexts: dict[str, ssl.SSLContext] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"sandbox test run {self.run_id}"))
            .issuer_name(_name(f"sandbox test run {self.run_id}"))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID)
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
            .sign(self._key, hashes.SHA256())
        )

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def context_for(self, host: str) -> ssl.SSLContext:
        """A server context presenting a leaf for `host`, signed by this run's CA (cached)."""
        if host in self._contexts:
            return self._contexts[host]
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        try:
            alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alt = x509.DNSName(host)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(_name(host))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID)
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])  # h2 inside the tunnel cannot be inspected
        # load_cert_chain takes files: write the leaf to a private temp file, load, unlink.
        fd, path = tempfile.mkstemp(prefix="leaf-", suffix=".pem")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(leaf.public_bytes(serialization.Encoding.PEM))
                handle.write(
                    key.private_bytes(
                        serialization.Encoding.PEM,
                        serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption(),
                    )
                )
            context.load_cert_chain(path)
        finally:
            os.unlink(path)
        self._contexts[host] = context
        return context


def upstream_context(extra_ca_pem: str = "") -> ssl.SSLContext:
    """How the guard verifies real hosts: the system's CAs, plus any the workflow trusts."""
    context = ssl.create_default_context()
    if extra_ca_pem:
        context.load_verify_locations(cadata=extra_ca_pem)
    context.set_alpn_protocols(["http/1.1"])
    return context
