"""Whether an egress call went to the host an expectation names, whatever the step wrote.

A host in an expectation (`host = "okhost"`, `"okhost:443"`, `"10.0.0.5"`) matches
every call that reached, or would have reached, that host: written in any case, with
trailing dots, with its default port spelt out, as one of its addresses, or as the
target of a tunnel. Both sides are compared after `normalize_host`. Addresses are tied
to names only by what the guard itself resolved and wrote in the log: `detail.names`
(the allow-listed names an address resolved to), `detail.addresses` (what an
allow-listed name resolved to) and `detail.resolved` (the address an allowed call was
sent to), from any line of the log. An address whose names the guard could not
resolve (`detail.names_unresolved`) counts as each of them: the check fails closed.
A port in the expectation must be the call's (read from its URL, the scheme's
default when none is written); a call whose port cannot be read counts as any port.
"""

from __future__ import annotations

from collections import defaultdict
from urllib.parse import urlsplit

from sandbox.contracts.hostnames import address_of, normalize_host, split_host_port
from sandbox.verify.evidence import Call

_DEFAULT_PORTS = {"http": 80, "https": 443}


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def call_port(call: Call) -> int | None:
    url = str(call.line.arguments.get("url", ""))
    try:
        if call.method.upper() == "CONNECT" and "://" not in url:
            return split_host_port(url)[1]
        parts = urlsplit(url)
        return parts.port or _DEFAULT_PORTS.get(parts.scheme.lower())
    except ValueError:
        return None


class HostIndex:
    """The names and addresses the guard tied together anywhere in one log."""

    def __init__(self, calls: list[Call]) -> None:
        self._addresses: dict[str, set[str]] = defaultdict(set)
        self._names: dict[str, set[str]] = defaultdict(set)
        for call in calls:
            host = normalize_host(call.host)
            detail = call.line.detail
            if address_of(host) is not None:
                for name in _strings(detail.get("names")):
                    self._tie(normalize_host(name), host)
            else:
                for address in [
                    *_strings(detail.get("addresses")),
                    *_strings(detail.get("resolved")),
                ]:
                    self._tie(host, normalize_host(address))

    def _tie(self, name: str, address: str) -> None:
        self._addresses[name].add(address)
        self._names[address].add(name)

    def matches(self, expected: str, call: Call) -> bool:
        want, want_port = split_host_port(expected)
        if want_port is not None:
            port = call_port(call)
            if port is not None and port != want_port:
                return False
        host = normalize_host(call.host)
        if host == want:
            return True
        detail = call.line.detail
        if address_of(want) is None:  # a name: the call went to one of its addresses
            if address_of(host) is None:
                return False
            names = {normalize_host(n) for n in _strings(detail.get("names"))}
            unresolved = {normalize_host(n) for n in _strings(detail.get("names_unresolved"))}
            return want in names or want in unresolved or host in self._addresses[want]
        # An address: the call went to a name that resolved to it.
        own = [*_strings(detail.get("addresses")), *_strings(detail.get("resolved"))]
        return want in {normalize_host(a) for a in own} or host in self._names[want]
