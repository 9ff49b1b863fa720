"""Where the suite's files are, named once so a test file can move without its paths."""

from __future__ import annotations

from pathlib import Path

from testbed.paths import REPO

TESTS = Path(__file__).resolve().parent

__all__ = ["REPO", "TESTS"]
