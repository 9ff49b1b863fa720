"""A tiny client for the bridge, for scripts inside the step (stdlib only).

Installed in the step image as `agentworks_bridge`. It reads the bridge URL
and the run's token from the environment the sandbox sets, so a script calls
`agentworks_bridge.call("notify_user", {"text": "hi"})` and gets the tool
result (a stub reply in test mode). Plain HTTP + JSON, so `curl` works too:

    curl -s -H "Authorization: Bearer $AGENTWORKS_BRIDGE_TOKEN" \
         -d '{"tool":"notify_user","arguments":{"text":"hi"}}' \
         "$AGENTWORKS_BRIDGE_URL/v1/tools/call"
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any


class BridgeError(RuntimeError):
    """The bridge could not be reached or answered with an error status."""


def call(
    tool: str,
    arguments: dict[str, Any] | None = None,
    *,
    session: str | None = None,
    timeout_s: float = 660.0,
) -> dict[str, Any]:
    """Call one tool through the bridge; returns the reply object (see ToolReply)."""
    body: dict[str, Any] = {"tool": tool, "arguments": arguments or {}}
    if session is not None:
        body["session"] = session
    return _post("/v1/tools/call", body, timeout_s)


def result_text(reply: dict[str, Any]) -> str:
    """The text an agent reads for a reply (the stub reply when stubbed)."""
    return str(reply.get("result", {}).get("text", ""))


def _post(path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    url = os.environ.get("AGENTWORKS_BRIDGE_URL")
    token = os.environ.get("AGENTWORKS_BRIDGE_TOKEN", "")
    if not url:
        raise BridgeError("AGENTWORKS_BRIDGE_URL is not set: no bridge in this environment")
    request = urllib.request.Request(
        url.rstrip("/") + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        method="POST",
    )
    # The bridge is on loopback; never route it through the egress proxy.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            reply: dict[str, Any] = json.loads(response.read())
            return reply
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise BridgeError(f"bridge answered {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise BridgeError(f"bridge not reachable: {exc}") from None
