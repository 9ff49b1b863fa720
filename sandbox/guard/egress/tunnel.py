"""CONNECT tunnels: the TLS the proxy shows the step, the TLS it speaks to hosts, and
the blind relay of a host that opted out of inspection.

An inspected tunnel is terminated with this run's CA (`tls.RunCA`, loaded on the
first inspected CONNECT, so a run without HTTPS never pays for it) and offers only
`http/1.1` by ALPN: an HTTP/2 client falls back, and each request inside is parsed
and judged like a plain one.
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING

from sandbox.contracts.guardconfig import GuardConfig
from sandbox.guard.egress.http1 import Denied

if TYPE_CHECKING:
    from sandbox.guard.egress.tls import RunCA

ESTABLISHED = b"HTTP/1.1 200 Connection Established\r\n\r\n"


class TlsContexts:
    """The TLS contexts of one proxy, each made on first use."""

    def __init__(self, config: GuardConfig) -> None:
        self._config = config
        self._ca: RunCA | None = None
        self._to_hosts: ssl.SSLContext | None = None

    def for_step(self, host: str) -> ssl.SSLContext:
        """The context the proxy shows the step for `host`, signed by the run's CA."""
        if self._ca is None:
            config = self._config
            if not (config.egress_ca_pem and config.egress_ca_key_pem):
                raise Denied(403, "TLS inspection is on for this host but the run has no CA")
            from sandbox.guard.egress.tls import RunCA  # cryptography: on demand

            self._ca = RunCA.from_pem(config.egress_ca_pem, config.egress_ca_key_pem)
        return self._ca.context_for(host)

    def to_hosts(self) -> ssl.SSLContext:
        """The context the proxy dials real hosts with (the system's CAs and the run's
        extra trust)."""
        if self._to_hosts is None:
            from sandbox.guard.egress.tls import upstream_context

            self._to_hosts = upstream_context(self._config.egress_trust_pem)
        return self._to_hosts
