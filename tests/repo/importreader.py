"""What a module's source imports, read with `ast`: every import, also those inside a
function, plain and relative (resolved against the module's own package). One reader
for the repository checks that ask which modules import which.
"""

from __future__ import annotations

import ast


def imported_modules(source: str, name: str, is_package: bool = False) -> set[str]:
    """The dotted names the module `name` imports, a name imported from a module counted
    both as the module and as its possible submodule (`from a import b`: `a`, `a.b`)."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[: len(parts) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found
