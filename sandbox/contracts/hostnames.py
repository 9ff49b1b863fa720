"""One spelling of a host name or address, for every place that compares hosts.

`normalize_host` is the one rule: case folded, the trailing dots of a fully
qualified name dropped, brackets around an IPv6 address dropped, an address in its
canonical text (an IPv4-mapped IPv6 address as the IPv4 address it is). The guard's
lines (`detail.host`, `detail.names`, `detail.addresses`, `detail.resolved`) and an
expectation's `host` are compared only after it. `split_host_port` reads
`host[:port]` as an expectation or a CONNECT target writes it.
"""

from __future__ import annotations

import ipaddress
import re

_PORT = re.compile(r"^(?P<host>.*?)(?::(?P<port>[0-9]{1,5}))?$")


def address_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address `host` spells, if it is one (brackets and zone ids allowed)."""
    text = host.strip().strip("[]").split("%", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def normalize_host(host: str) -> str:
    address = address_of(host)
    if address is not None:
        return str(address)
    return host.strip().lower().rstrip(".")


def split_host_port(text: str) -> tuple[str, int | None]:
    """`host`, `host:port`, `[v6]`, `[v6]:port` or a bare IPv6 address, normalized."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") and rest[1:].isdigit() else None
        return normalize_host(host), int(port) if port else None
    if text.count(":") > 1:  # a bare IPv6 address has no port
        return normalize_host(text), None
    match = _PORT.match(text)
    assert match is not None  # the pattern matches any text
    port = match.group("port")
    return normalize_host(match.group("host")), int(port) if port else None
