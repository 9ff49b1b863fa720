"""The guard entry's binder of the packet log: on the path to the guard's first answer,
so it loads only what binding a netlink socket takes.

Checked through `sys.modules` of a new interpreter running the module the entry script
names (never by timing): each module named here costs every run's guard its import
before the guard's own interpreter even starts.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

from sandbox.launch.firewall import guard_entry_script

# What the packets' parsing needs (the guard itself loads it), not the binding.
NOT_FOR_THE_BINDER = ("dataclasses", "inspect", "ipaddress", "pydantic", "asyncio", "json")


def binder_module() -> str:
    """The module the guard's entry runs as root before the drop."""
    last = shlex.split(guard_entry_script(["guard"]).strip().splitlines()[-1])
    assert last[:3] == ["exec", "guard", "-m"]
    return last[3]


def test_the_entrys_binder_imports_only_what_binding_takes() -> None:
    module = binder_module()
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{module!r}]\n"  # no command: it says so and exits 2 before binding
        "before = set(sys.modules)\n"
        "try:\n"
        f"    runpy.run_module({module!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "sys.stdout.write('\\n'.join(sorted(set(sys.modules) - before)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = set(done.stdout.split())
    assert {"socket", "sandbox.contracts.guardprocess"} <= loaded  # it sees real imports
    assert sorted(n for n in loaded if n.split(".")[0] in NOT_FOR_THE_BINDER) == []
