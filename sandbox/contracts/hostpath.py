"""Where the host's settings file is (`sandbox.contracts.hostconfig` reads it).

Apart from the settings' models so that a command can tell "no host config: this
host's Docker engine runs everything" before it loads pydantic (`sandbox run` asks the
engine for its version while it imports; see `sandbox.backends.docker.prefetch`).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PATH = Path("/etc/sandbox/host.toml")
PATH_ENV = "SANDBOX_HOST_CONFIG"


def host_config_path(path: Path | None = None) -> Path | None:
    """The host config file in effect: `path`, else `$SANDBOX_HOST_CONFIG`, else
    `/etc/sandbox/host.toml` when it exists; None: there is none."""
    if path is not None:
        return path
    named = os.environ.get(PATH_ENV)
    return Path(named) if named else (DEFAULT_PATH if DEFAULT_PATH.is_file() else None)
