"""`python -m sandbox.cli`: the console script."""

from sandbox.cli.main import console

console()
