"""`python -m sandbox.guard`: bind the ports, then start the guard from its config file.

Only the standard library is imported before the ports listen (see
`sandbox.guard.listeners`); the web stack comes after.
"""

from __future__ import annotations

import json
import os
import sys

from sandbox.guard.listeners import (
    BRIDGE_PORT,
    CONFIG_FILE_ENV,
    EGRESS_PORT,
    bind_loopback,
)


def _take_config_text() -> bytes | None:
    """Read the config file once and remove it, so nothing started later can read it."""
    path = os.environ.pop(CONFIG_FILE_ENV, None)
    if not path:
        print(f"guard: {CONFIG_FILE_ENV} is not set", file=sys.stderr)
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(4 * 1024 * 1024)
        os.unlink(path)
    except OSError as exc:
        print(f"guard: config file {path} unreadable: {exc}", file=sys.stderr)
        return None
    return raw


def _port(document: object, key: str, default: int) -> int:
    value = document.get(key, default) if isinstance(document, dict) else default
    return value if isinstance(value, int) and 0 < value < 65536 else default


def main() -> int:
    raw = _take_config_text()
    if raw is None:
        return 2
    try:
        document = json.loads(raw)
    except ValueError as exc:
        print(f"guard: config file is not JSON: {exc}", file=sys.stderr)
        return 2
    try:
        # Egress first: the bridge port listening is what the step waits for.
        egress = bind_loopback(_port(document, "egress_port", EGRESS_PORT))
        bridge = bind_loopback(_port(document, "bridge_port", BRIDGE_PORT))
    except OSError as exc:
        print(f"guard: cannot listen: {exc}", file=sys.stderr)
        return 2
    from sandbox.guard.serve import serve  # the web stack: after the ports listen

    return serve(raw, bridge=bridge, egress=egress)


if __name__ == "__main__":
    sys.exit(main())
