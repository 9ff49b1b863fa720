"""The executor: the local and DB tools by name, every failure a readable result."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .db import DbTools
from .filetools import FileTools
from .results import ToolError, tool_result
from .shell import ShellTool


class Executor(FileTools, ShellTool, DbTools):
    """The local and DB tools, rooted at one folder."""

    def __init__(self, root: str, *, resolved: bool = False) -> None:
        """`resolved`: `root` is already the real path (resolved before the step started,
        which may change the folders under it from then on)."""
        self.root = root if resolved else os.path.realpath(root)
        self._tools: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "read_file": self.read_file,
            "write_file": self.write_file,
            "edit_file": self.edit_file,
            "list_dir": self.list_dir,
            "search_files": self.search_files,
            "execute_shell_command": self.execute_shell_command,
            "query_workflow_db": self.query_workflow_db,
            "mutate_workflow_db": self.mutate_workflow_db,
            "agentworks_db": self.mutate_workflow_db,
        }

    def call(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Run one tool; never raises, every failure is an ``is_error`` result."""
        handler = self._tools.get(tool)
        if handler is None:
            return tool_result(f"unknown local tool: {tool!r}", is_error=True)
        try:
            return handler(arguments)
        except ToolError as exc:
            return tool_result(f"{tool}: {exc}", is_error=True)
        except Exception as exc:
            return tool_result(
                f"{tool}: internal error: {type(exc).__name__}: {exc}", is_error=True
            )
