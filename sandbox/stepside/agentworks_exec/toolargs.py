"""How long a local tool may run: one answer for the guard and the step's executor.

The executor (in the step container) enforces the limit; the guard waits for the
executor's reply. Both read the limit from here, so the guard never gives up on
a call the executor is still allowed to run (a shell command's `timeout_s` of
`"300"` is 300 s to both). Standard library only: the step image installs this
file as ``agentworks_toolargs.py``.
"""

from __future__ import annotations

import math

# Not `typing.TYPE_CHECKING`: `typing` alone costs the executor's start-up ~10 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

SHELL_DEFAULT_TIMEOUT_S: Final = 120.0
SHELL_MIN_TIMEOUT_S: Final = 1.0
SHELL_MAX_TIMEOUT_S: Final = 600.0
# After its deadline the executor kills the command's process group and reads what
# is left of its output for at most this long.
SHELL_KILL_GRACE_S: Final = 2.0
SEARCH_DEADLINE_S: Final = 60.0
DB_BUSY_TIMEOUT_S: Final = 10.0
DB_STATEMENT_DEADLINE_S: Final = 60.0
# Every other local tool (file reads and writes) is bounded by its size caps.
OTHER_TOOL_DEADLINE_S: Final = 60.0
DB_TOOLS: Final = frozenset({"query_workflow_db", "mutate_workflow_db", "agentworks_db"})


def shell_timeout_s(value: Any) -> float:
    """A shell command's timeout from its `timeout_s` argument, clamped to [1, 600] s.

    Absent (None) is the default of 120 s; a number or a numeric string is taken;
    anything else (a bool, NaN, text) raises ValueError with the message the step gets."""
    if value is None:
        return SHELL_DEFAULT_TIMEOUT_S
    if isinstance(value, bool):
        raise ValueError("argument 'timeout_s' must be a number of seconds")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError("argument 'timeout_s' must be a number of seconds") from None
    if not isinstance(value, int | float) or math.isnan(value):
        raise ValueError("argument 'timeout_s' must be a number of seconds")
    return min(max(float(value), SHELL_MIN_TIMEOUT_S), SHELL_MAX_TIMEOUT_S)


def executor_deadline_s(tool: str, arguments: dict[str, Any]) -> float:
    """The longest the executor may take to answer `tool` with these arguments.

    A shell command whose `timeout_s` is invalid is refused at once by the executor;
    its deadline here is the default one."""
    if tool == "execute_shell_command":
        try:
            timeout = shell_timeout_s(arguments.get("timeout_s"))
        except ValueError:
            timeout = SHELL_DEFAULT_TIMEOUT_S
        return timeout + SHELL_KILL_GRACE_S
    if tool in DB_TOOLS:
        return DB_BUSY_TIMEOUT_S + DB_STATEMENT_DEADLINE_S
    if tool == "search_files":
        return SEARCH_DEADLINE_S
    return OTHER_TOOL_DEADLINE_S
