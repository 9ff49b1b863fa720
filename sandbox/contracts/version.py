"""The runner's version: the installed distribution's (pyproject's `version`).

One source for `sandbox --version`, `sandbox.__version__` and the `runner_version` of
every record, so a record says which runner wrote it.
"""

from __future__ import annotations

import functools
from importlib import metadata

DISTRIBUTION = "sandbox"
# Imported from a tree that was never installed (no metadata to read): said, not guessed.
UNKNOWN = "0+unknown"


@functools.cache
def runner_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNKNOWN
