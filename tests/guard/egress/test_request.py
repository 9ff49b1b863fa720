"""Allow-list matching of the egress proxy (pure)."""

from __future__ import annotations

import pytest

from sandbox.contracts.config import Egress
from sandbox.guard.egress.request import match

EGRESS = Egress.model_validate(
    {
        "allow": [
            "api.example.org",
            {"host": "*.cdn.example.org"},
            {"host": "files.example.org", "port": 8080},
            {"host": "secure.example.org", "port": 8443, "tls": True},
            {"host": "models.example.org", "model": True},
        ]
    }
)


@pytest.mark.parametrize(
    ("host", "port", "tunnel", "expected"),
    [
        ("api.example.org", 80, False, "api.example.org"),
        ("API.Example.Org.", 80, False, "api.example.org"),
        ("api.example.org", 443, True, "api.example.org"),
        ("api.example.org", 443, False, None),  # plain HTTP to 443: not a listed use
        ("api.example.org", 8080, False, None),
        ("img.cdn.example.org", 80, False, "*.cdn.example.org"),
        ("a.b.cdn.example.org", 443, True, "*.cdn.example.org"),
        ("cdn.example.org", 80, False, None),  # a wildcard does not match its apex
        ("evilcdn.example.org", 80, False, None),
        ("files.example.org", 8080, False, "files.example.org"),
        ("files.example.org", 8080, True, None),  # no blind tunnel to a plain-HTTP port
        ("files.example.org", 80, False, None),
        ("secure.example.org", 8443, True, "secure.example.org"),
        ("secure.example.org", 8443, False, None),
        ("example.org", 80, False, None),
        ("api.example.org.evil.test", 80, False, None),
    ],
)
def test_match(host: str, port: int, tunnel: bool, expected: str | None) -> None:
    entry = match(EGRESS, host, port, tunnel=tunnel)
    assert (entry.host if entry else None) == expected


def test_empty_list_admits_nothing() -> None:
    assert match(Egress(), "api.example.org", 80, tunnel=False) is None


def test_model_entries_are_marked() -> None:
    entry = match(EGRESS, "models.example.org", 443, tunnel=True)
    assert entry is not None and entry.model
