"""`sandbox`: the command line, a thin layer over the Python API (`sandbox.cli.main`)."""

from sandbox.cli.main import console, main

__all__ = ["console", "main"]
