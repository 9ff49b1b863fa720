"""A request refused on its head alone: header lines past the cap, a declared body past it."""

from __future__ import annotations

from sandbox.guard import limits
from sandbox.guard.requestcaps import refused_head


def test_headers_past_the_cap_are_431() -> None:
    room = limits.MAX_HEADER_BYTES - len(b"x-pad") - 4
    assert refused_head([(b"x-pad", b"a" * room)]) is None
    refusal = refused_head([(b"x-pad", b"a" * (room + 1))])
    assert refusal is not None and refusal[0] == 431


def test_the_first_declared_length_decides() -> None:
    over = str(limits.MAX_REQUEST_BYTES + 1).encode()
    refusal = refused_head([(b"content-length", over), (b"content-length", b"1")])
    assert refusal is not None and refusal[0] == 413
    assert refused_head([(b"content-length", b"1"), (b"content-length", over)]) is None
    assert refused_head([(b"content-length", str(limits.MAX_REQUEST_BYTES).encode())]) is None
    assert refused_head([(b"content-length", b"")]) is None
    assert refused_head([]) is None
