"""Where the checkout is, named once so a module of the testbed can move without its paths."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
