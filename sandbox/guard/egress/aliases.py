"""Which allow-listed names an address is, and which addresses a name is, as this
guard resolves them: what lets a record tie a call to a host whatever the step wrote.

A step that sends its request to an allowed host's address instead of its name still
reached that host; an expectation about the host must see it (`sandbox.verify`). So
an egress line whose host is an address says which of the allow list's names resolve
to it here (`detail.names`), and one whose host is an allow-listed name says the
addresses it resolves to (`detail.addresses`). Wildcard entries name no host to
resolve. Each name is resolved once per proxy, with a deadline; a name that could not
be resolved is listed in `detail.names_unresolved`, so a reader knows the mapping may
miss it. Only allow-list names are ever looked up: a step cannot make the guard
resolve a name of its choosing.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from sandbox.contracts.guardparts import Egress
from sandbox.contracts.hostnames import address_of, normalize_host

RESOLVE_DEADLINE_S = 3.0
# Hosts whose answer is remembered: every request of a step asks again for the same
# few hosts, and the answer (from names resolved once) never changes. Bounded, since
# the step chooses the hosts it names.
MEMO_HOSTS = 256


class HostAliases:
    def __init__(self, egress: Egress) -> None:
        names = [normalize_host(entry.host) for entry in egress.allow]
        self._names = sorted({n for n in names if address_of(n) is None and "*" not in n})
        self._known: dict[str, list[str] | None] = {}  # None: could not be resolved
        self._memo: dict[str, dict[str, Any]] = {}
        self._lock = asyncio.Lock()

    async def _addresses(self, name: str) -> list[str] | None:
        async with self._lock:
            if name not in self._known:
                self._known[name] = await _resolve(name)
            return self._known[name]

    def remembered(self, host: str) -> dict[str, Any] | None:
        """`detail(host)` without a wait when its answer is known already (every request
        but a host's first: no coroutine made per request); None when it is not."""
        if not self._names:  # an allow list of addresses and wildcards: nothing to add
            return {}
        found = self._memo.get(host)
        if found is None:
            return None
        return {key: list(value) for key, value in found.items()}

    async def detail(self, host: str) -> dict[str, Any]:
        """What an egress line to `host` adds to its detail (nothing for other names);
        a new dict each time (the caller's to change)."""
        if not self._names:  # an allow list of addresses and wildcards: nothing to add
            return {}
        found = self._memo.get(host)
        if found is None:
            found = await self._detail(normalize_host(host))
            if len(self._memo) >= MEMO_HOSTS:
                self._memo.clear()
            self._memo[host] = found
        return {key: list(value) for key, value in found.items()}

    async def _detail(self, host: str) -> dict[str, Any]:
        if address_of(host) is not None:
            names, unresolved = [], []
            for name in self._names:
                addresses = await self._addresses(name)
                if addresses is None:
                    unresolved.append(name)
                elif host in addresses:
                    names.append(name)
            found: dict[str, Any] = {"names": names}
            if unresolved:
                found["names_unresolved"] = unresolved
            return found
        if host in self._names:
            addresses = await self._addresses(host)
            return {"addresses": addresses} if addresses is not None else {}
        return {}


async def _resolve(name: str) -> list[str] | None:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_DEADLINE_S):
            infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):
        return None
    return sorted({normalize_host(str(info[4][0])) for info in infos})
