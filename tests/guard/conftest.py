"""Fixtures the guard's tests share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def opened_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path `os.open` is called with from here on, in order (the files a
    recording makes, counted without changing what they hold)."""
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: str | Path, flags: int, mode: int = 0o777) -> int:
        opened.append(os.fspath(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", counting_open)
    return opened
