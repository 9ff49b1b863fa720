"""The names every part of a run agrees on: its images and the labels of its containers.

`SANDBOX_IMAGE_TAG` names the image tag (`current` by default), so several checkouts
on one engine (parallel CI jobs, a developer beside CI) never run each other's images.
The labels are what `sandbox gc` reads to tell a live run's container from an orphan:
every container of a run carries the run's id and root, its role, and its runner's pid
and start time.
"""

from __future__ import annotations

import re
from typing import Final

from sandbox.contracts.settings import runner_settings

IMAGE_TAG: Final = runner_settings().image_tag
STEP_IMAGE: Final = f"sandbox-step:{IMAGE_TAG}"
GUARD_IMAGE: Final = f"sandbox-guard:{IMAGE_TAG}"
MCP_IMAGE: Final = f"sandbox-mcp:{IMAGE_TAG}"

# What names an image's content: an engine's image id, or a reference by digest. A tag
# names whatever was pushed under it last, so a version hash over a tag covers no code.
IMAGE_ID_PATTERN: Final = r"sha256:[0-9a-f]{64}"
DIGEST_REF_PATTERN: Final = r"[^@\s]+@sha256:[0-9a-f]{64}"


def names_content(image: str) -> bool:
    """True for an image id (`sha256:<64 hex>`) or a digest reference (`...@sha256:<64 hex>`)."""
    return re.fullmatch(IMAGE_ID_PATTERN, image) is not None or is_digest_ref(image)


def is_digest_ref(image: str) -> bool:
    return re.fullmatch(DIGEST_REF_PATTERN, image) is not None


LABEL_MANAGED: Final = "sandbox.managed"
LABEL_RUN_ID: Final = "sandbox.run-id"
LABEL_RUN_ROOT: Final = "sandbox.run-root"
LABEL_ROLE: Final = "sandbox.role"
LABEL_RUNNER_PID: Final = "sandbox.runner-pid"
LABEL_RUNNER_START: Final = "sandbox.runner-start"
# The runner's start in clock ticks since boot, and that boot's id: what `gc` compares
# (a clock step moves `runner-start`, never these).
LABEL_RUNNER_TICKS: Final = "sandbox.runner-ticks"
LABEL_RUNNER_BOOT: Final = "sandbox.runner-boot"
LABEL_MCP_SERVER: Final = "sandbox.mcp-server"
