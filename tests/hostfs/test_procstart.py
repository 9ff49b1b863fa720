"""The runner's start time from /proc is psutil's, to the bit: `sandbox gc` and the lock
compare the recorded one with psutil's to tell a live runner from a reused pid."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from sandbox.hostfs.procstart import boot_time, process_start


def test_boot_time_is_psutils() -> None:
    assert boot_time() == psutil.boot_time()


def test_a_process_start_is_psutils_create_time() -> None:
    # This process, pid 1, and a child whose command name has a space and a ')' in it
    # (the stat line's name field is parsed from its last ')').
    rename = "open('/proc/self/comm', 'w').write('odd ) name'); print('named', flush=True)"
    child = subprocess.Popen(
        [sys.executable, "-c", f"import sys; {rename}; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "named\n"
        assert psutil.Process(child.pid).name() == "odd ) name"
        for pid in (os.getpid(), 1, child.pid):
            assert process_start(pid) == psutil.Process(pid).create_time()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)


def test_a_process_that_is_gone_is_an_oserror() -> None:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    with pytest.raises(OSError):
        process_start(int(child.stdout))
