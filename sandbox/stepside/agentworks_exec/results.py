"""Tool results and argument parsing shared by every tool of the executor."""

from __future__ import annotations

from .toolargs import (
    shell_timeout_s,
)

# Not `typing.TYPE_CHECKING`: `typing` alone costs the executor's start-up ~10 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class ToolError(Exception):
    """A tool call that cannot be done; its message is the result's text."""


def tool_result(text: str, data: Any = None, *, is_error: bool = False) -> dict[str, Any]:
    return {"text": text, "data": data, "is_error": is_error}


def str_arg(args: dict[str, Any], name: str, default: str | None = None) -> str:
    value = args.get(name, default)
    if value is None:
        raise ToolError(f"missing argument '{name}'")
    if not isinstance(value, str):
        raise ToolError(f"argument '{name}' must be a string")
    return value


def int_arg(args: dict[str, Any], name: str, default: int, minimum: int) -> int:
    value = args.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool):
        raise ToolError(f"argument '{name}' must be an integer")
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ToolError(f"argument '{name}' must be an integer") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise ToolError(f"argument '{name}' must be an integer")
    if value < minimum:
        raise ToolError(f"argument '{name}' must be at least {minimum}")
    return value


def timeout_arg(args: dict[str, Any]) -> float:
    try:
        return shell_timeout_s(args.get("timeout_s"))
    except ValueError as exc:
        raise ToolError(str(exc)) from None


def params_arg(args: dict[str, Any]) -> list[Any] | dict[str, Any]:
    value = args.get("params")
    if value is None:
        return []
    if isinstance(value, list | dict):
        return value
    raise ToolError("argument 'params' must be a list (or an object of named parameters)")


def os_reason(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "no such file or folder"
    if isinstance(exc, IsADirectoryError):
        return "is a folder, not a file"
    if isinstance(exc, NotADirectoryError):
        return "a part of the path is not a folder"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return exc.strerror or str(exc)
