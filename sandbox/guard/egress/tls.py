"""TLS inspection for the egress proxy: a certificate authority made for one run only.

Inspection is on by default for every allow-listed host that admits CONNECT
(see `sandbox.contracts.config.Egress.inspects`). The runner makes the run's CA before any
container exists (`RunCA.new`, about a millisecond) and puts its certificate
into the step's trust (a CA bundle and the usual environment variables) when it
creates the step's container, and into the trust of each stdio MCP server whose
own egress list is inspected, so no run waits for the guard to make one. The
CA's key goes to the guard in its 0600 config file, which the guard reads and
deletes before it starts anything (as it does the tokens); it then lives only
in the guard process's memory, never in the step's or a server's container,
and dies with the run (the CA is valid for two days at most and trusted by
that run's containers only). For an inspected CONNECT the proxy terminates TLS with a leaf
certificate for that host, judges the request inside like plain HTTP, and sends
allowed requests on over a verified TLS connection to the real host.
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

VALID = datetime.timedelta(days=2)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


@dataclass
class RunCA:
    """One run's CA: `context_for(host)` gives a server-side TLS context for that host."""

    cert: x509.Certificate
    _key: ec.EllipticCurvePrivateKey = field(repr=False)
    _contexts: dict[str, ssl.SSLContext] = field(default_factory=dict, repr=False)

    @classmethod
    def new(cls, run_id: str) -> RunCA:
        """A fresh CA named for the run (made by the runner, before the run starts)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"sandbox test run {run_id}"))
            .issuer_name(_name(f"sandbox test run {run_id}"))
            .public_key(key.public_key())
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
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def from_pem(cls, cert_pem: str, key_pem: str) -> RunCA:
        """The run's CA as the guard gets it from its config file."""
        key = serialization.load_pem_private_key(key_pem.encode(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("the run's CA key is not an EC key")
        return cls(x509.load_pem_x509_certificate(cert_pem.encode()), key)

    def key_pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
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
