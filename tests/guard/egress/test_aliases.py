"""An egress line's host aliases (`sandbox.guard.egress.aliases`): the allow list's names
an address is and the addresses a name is, remembered per host the step names, each
answer the caller's own, and the memo bounded whatever hosts the step names.

"localhost" stands in for an allow-listed name: the host's own resolver answers it
without any traffic leaving the machine."""

from __future__ import annotations

import asyncio

from sandbox.contracts.config import Egress
from sandbox.guard.egress.aliases import MEMO_HOSTS, HostAliases


def _aliases(*hosts: str) -> HostAliases:
    return HostAliases(Egress(allow=[{"host": h, "port": 80} for h in hosts]))  # type: ignore[misc]


def test_an_address_is_tied_to_the_allowed_name_it_is_whatever_the_spelling() -> None:
    async def test() -> None:
        aliases = _aliases("localhost", "10.0.0.1")
        first = await aliases.detail("127.0.0.1")
        assert first["names"] == ["localhost"]
        first["names"].append("changed by the caller")  # a line's detail is built from it
        assert await aliases.detail("127.0.0.1") == {"names": ["localhost"]}
        named = await aliases.detail("LOCALHOST.")
        assert "127.0.0.1" in named["addresses"]
        assert await aliases.detail("localhost") == named

    asyncio.run(test())


def test_an_allow_list_of_addresses_adds_nothing_to_any_line() -> None:
    async def test() -> None:
        aliases = _aliases("127.0.0.1", "[::1]")
        assert await aliases.detail("127.0.0.1") == {}
        assert await aliases.detail("localhost") == {}

    asyncio.run(test())


def test_a_step_naming_many_hosts_cannot_grow_the_memo_past_its_bound() -> None:
    async def test() -> None:
        aliases = _aliases("localhost")
        for n in range(3 * MEMO_HOSTS):
            assert await aliases.detail(f"10.{n // 256}.{n % 256}.1") == {"names": []}
        assert len(aliases._memo) <= MEMO_HOSTS
        assert await aliases.detail("127.0.0.1") == {"names": ["localhost"]}

    asyncio.run(test())


def test_a_remembered_answer_is_given_without_a_wait_and_is_the_callers_own() -> None:
    async def test() -> None:
        aliases = _aliases("localhost")
        assert aliases.remembered("127.0.0.1") is None  # not asked yet: it must be awaited
        assert await aliases.detail("127.0.0.1") == {"names": ["localhost"]}
        first = aliases.remembered("127.0.0.1")
        assert first == {"names": ["localhost"]}
        first["names"].append("changed by the caller")
        assert aliases.remembered("127.0.0.1") == {"names": ["localhost"]}
        assert _aliases("127.0.0.1").remembered("localhost") == {}

    asyncio.run(test())
