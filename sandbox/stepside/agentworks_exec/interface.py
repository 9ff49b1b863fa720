"""What the runner and the executor agree on: an environment variable the runner sets
and a report line the executor writes on stderr.

Constants only, so the runner (`sandbox.launch.specs`, `sandbox.collect.stepreports`) names
them without loading the executor's server, tools and their imports.
"""

from __future__ import annotations

# Not `typing.TYPE_CHECKING`: `typing` alone costs the executor's start-up ~10 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

# host:port of the guard; the step command starts only once the guard listens there.
GUARD_WAIT_ENV: Final = "AGENTWORKS_WAIT_FOR_GUARD"

# `AGENTWORKS_USAGE {json}`: the step's CPU time and largest RSS, once it exited.
USAGE_MARK: Final = "AGENTWORKS_USAGE"

# `require` or `apply`: the Landlock wall the executor puts on itself before the step
# starts (agentworks_exec.walls); unset, none.
LANDLOCK_ENV: Final = "AGENTWORKS_LANDLOCK"

# `AGENTWORKS_LANDLOCK_REPORT {json}`: the wall as the executor made it, before the step.
LANDLOCK_MARK: Final = "AGENTWORKS_LANDLOCK_REPORT"

# The executor's exit code when the wall is required and the kernel did not give it.
LANDLOCK_REFUSED_EXIT: Final = 95
