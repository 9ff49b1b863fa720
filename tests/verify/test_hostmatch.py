"""Hosts compared one way: the spelling rule, and a call matched by its host's addresses."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from sandbox.contracts.hostnames import normalize_host, split_host_port
from sandbox.contracts.wire import ActionLine
from sandbox.verify.evidence import Call
from sandbox.verify.hostmatch import HostIndex


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("OkHost", "okhost"),
        ("okhost.", "okhost"),
        ("OKHOST..", "okhost"),
        ("[2001:DB8::1]", "2001:db8::1"),
        ("2001:0db8:0:0:0:0:0:1", "2001:db8::1"),
        ("::ffff:10.0.0.5", "10.0.0.5"),
        ("10.0.0.5", "10.0.0.5"),
    ],
)
def test_one_spelling(text: str, expected: str) -> None:
    assert normalize_host(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("okhost", ("okhost", None)),
        ("OKHOST.:443", ("okhost", 443)),
        ("[::1]:8080", ("::1", 8080)),
        ("::1", ("::1", None)),
        ("10.0.0.5:80", ("10.0.0.5", 80)),
    ],
)
def test_host_and_port(text: str, expected: tuple[str, int | None]) -> None:
    assert split_host_port(text) == expected


def call(host: str, url: str, method: str = "POST", **detail: Any) -> Call:
    line = ActionLine(
        time=datetime.now(UTC),
        session="egress",
        tool="http",
        decision="stub",
        reason="",
        arguments={"method": method, "url": url},
        detail={"host": host, **detail},
    )
    return Call(1, line, "")


def test_a_call_to_an_address_matches_the_name_the_guard_resolved_to_it() -> None:
    by_address = call("10.0.0.5", "http://10.0.0.5/effect", names=["okhost"])
    index = HostIndex([by_address])
    for spelt in ("okhost", "OKHOST.", "okhost:80", "10.0.0.5", "[::ffff:10.0.0.5]"):
        assert index.matches(spelt, by_address), spelt
    assert not index.matches("okhost:443", by_address)
    assert not index.matches("otherhost", by_address)


def test_a_name_matches_an_address_another_line_tied_to_it() -> None:
    """A wildcard entry's name is never resolved up front: an allowed call to it tells
    which address it went to, and a later call to that address is the same host."""
    by_name = call("api.example.org", "http://api.example.org/", "GET", resolved="192.0.2.7")
    by_address = call("192.0.2.7", "http://192.0.2.7/", names=[])
    index = HostIndex([by_name, by_address])
    assert index.matches("api.example.org", by_address)
    assert index.matches("192.0.2.7", by_name)
    assert not index.matches("other.example.org", by_address)


def test_an_address_matches_a_call_by_name_that_resolved_to_it() -> None:
    by_name = call("okhost", "https://okhost/x", addresses=["10.0.0.5", "2001:db8::5"])
    index = HostIndex([by_name])
    assert index.matches("10.0.0.5", by_name)
    assert index.matches("[2001:db8::5]:443", by_name)
    assert not index.matches("10.0.0.6", by_name)


def test_an_address_whose_names_could_not_be_resolved_fails_closed() -> None:
    unsure = call("10.0.0.5", "http://10.0.0.5/", names=[], names_unresolved=["okhost"])
    assert HostIndex([unsure]).matches("okhost", unsure)


def test_a_connect_target_has_its_port() -> None:
    tunnel = call("okhost", "okhost:8443", method="CONNECT")
    index = HostIndex([tunnel])
    assert index.matches("okhost:8443", tunnel)
    assert not index.matches("okhost:443", tunnel)


def test_a_tunnel_relayed_unopened_may_have_carried_any_method() -> None:
    from types import SimpleNamespace

    from sandbox.verify.check import check_no_call
    from sandbox.verify.expect import NoCallExpectation

    blind = call("okhost", "okhost:8443", method="CONNECT", tls="method not seen")
    facts: Any = SimpleNamespace(
        calls=[blind], log_truncated=False, log_full=False, malformed_lines=0
    )
    no_post = NoCallExpectation(kind="no_call", method="POST", host="okhost")
    assert not check_no_call(no_post, facts).ok
    elsewhere = NoCallExpectation(kind="no_call", method="POST", host="otherhost")
    assert check_no_call(elsewhere, facts).ok
