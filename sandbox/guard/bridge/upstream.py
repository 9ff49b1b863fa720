"""What the guard's client for the real bridge hands back: a reply, or why there is none.

The client itself is `sandbox.guard.bridge.client` (HTTP/1.1 parsed by httptools, no
retries). These types are its contract with the bridge (`sandbox.guard.bridge.routes`): a
forwarded call's bytes are written at most once, and once any of them went out a
failure is reported with `sent=True` and never a reason to send the call again (the
upstream may have run it); only a connection that could not be made is `sent=False`.
"""

from __future__ import annotations

from dataclasses import dataclass


class UpstreamError(Exception):
    """The exchange failed. `sent`: the request's bytes (some of them) went out, so the
    upstream may have acted on it."""

    def __init__(self, reason: str, *, sent: bool) -> None:
        super().__init__(reason)
        self.sent = sent


class ReplyTooLarge(UpstreamError):
    """The reply's body is larger than the client's cap (`bridge.client.MAX_BODY_BYTES`;
    never read whole). The request went out, so this is always `sent=True`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, sent=True)


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
