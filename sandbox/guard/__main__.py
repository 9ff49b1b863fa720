"""`python -m sandbox.guard`: start the guard from the config in its environment."""

from __future__ import annotations

import os
import sys

import uvicorn

from sandbox.guard.actionlog import ActionLog
from sandbox.guard.bridge import Guard, build_app
from sandbox.guard.config import CONFIG_ENV, GuardConfig


def main() -> int:
    raw = os.environ.pop(CONFIG_ENV, None)
    if raw is None:
        print(f"guard: {CONFIG_ENV} is not set", file=sys.stderr)
        return 2
    config = GuardConfig.model_validate_json(raw)
    log = ActionLog(
        config.actions_path,
        secrets=(config.bridge_token, config.exec_token),
        fsync_each=config.fsync_each,
    )
    guard = Guard(config, log)
    uvicorn.run(
        build_app(guard),
        host="127.0.0.1",
        port=config.bridge_port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
