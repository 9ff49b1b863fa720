"""`sandbox`: the command line, a thin layer over the Python API (`sandbox.cli.main`)."""

from sandbox.cli.main import console, main
from sandbox.cli.parser import build_parser

__all__ = ["build_parser", "console", "main"]
