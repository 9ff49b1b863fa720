"""`--load`: the same figures with other work beside them, as on a shared build host.

A CPU hog (one process spinning on one of the CPUs) and a disk hog (rewriting 1 MiB
blocks of a 256 MiB file in the bench's scratch folder, on the runs' disk, with an
fdatasync after each) run for the whole bench. Bounded: each ends by itself after
`LOAD_MAX_S`, and both are stopped (by their pids) when the bench ends.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from bench.common import PROGRAMS

LOAD_MAX_S = 1800.0


@contextlib.contextmanager
def hogs(work: Path, seconds: float = LOAD_MAX_S) -> Iterator[None]:
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROGRAMS / "hog.py"), kind, str(seconds), str(work / "hog.bin")],
            stdin=subprocess.DEVNULL,
        )
        for kind in ("cpu", "disk")
    ]
    try:
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        (work / "hog.bin").unlink(missing_ok=True)
