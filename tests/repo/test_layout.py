"""The house's layout holds: no module over 700 lines, no import cycle between the
package's modules, and no import upward (a phase never reaches for what sequences it,
a guard subsystem never for the application assembled from it, the contracts and the
code inside the step's image for nothing mechanical). Between the checkout's top-level
packages too: the bench and the testbed (the local cluster, the second engines) never
import the suite, the testbed never the bench, and the package (what a wheel ships)
neither the suite nor the testbed.

Read from the source with `ast` (every import, also those inside a function or under
`TYPE_CHECKING`: a cycle there is still two modules that cannot be read apart).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from tests import paths
from tests.repo.importreader import imported_modules

MAX_LINES = 700
# Modules allowed over the mark until they are split; listed so the list can only shrink.
OVER_THE_MARK: set[str] = set()


def modules(root: str = "sandbox") -> dict[str, Path]:
    """Every module of a package by dotted name (a package by its `__init__`)."""
    found = {}
    for path in sorted((paths.REPO / root).rglob("*.py")):
        parts = list(path.relative_to(paths.REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """Which of the package's modules each module imports (a name imported from a
    package counts as its submodule when there is one, else as the package)."""
    known = modules()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names if a.name.startswith("sandbox"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                if base == "sandbox" or base.startswith("sandbox."):
                    targets.update(resolve(f"{base}.{a.name}") or resolve(base) for a in node.names)
        graph[name] = frozenset(t for t in targets if t and t != name)
    return graph


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle_through_three_modules() -> None:
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({**graph, "c": frozenset()}) == []


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def suite_modules() -> list[Path]:
    """The suite's modules: test files and their fixtures, fakes, engines, clusters."""
    return [
        p
        for p in sorted(paths.TESTS.rglob("*.py"))
        if "data" not in p.relative_to(paths.TESTS).parts
    ]


def test_no_module_is_over_the_mark() -> None:
    checked = [
        *modules("sandbox").values(),
        *modules("bench").values(),
        *modules("testbed").values(),
        *suite_modules(),
    ]
    over = {
        str(p.relative_to(paths.REPO))
        for p in checked
        if len(p.read_text().splitlines()) > MAX_LINES
    }
    assert over - OVER_THE_MARK == set()
    # One split off the list takes it off the list.
    assert over >= OVER_THE_MARK


def importers_of(prefix: str) -> set[str]:
    return {
        name
        for name, targets in import_graph().items()
        if any(t == prefix or t.startswith(prefix + ".") for t in targets)
    }


def inside(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


@pytest.mark.parametrize(
    ("imported", "allowed"),
    [
        # The command line is the top: nothing imports it.
        ("sandbox.cli", ()),
        # The sequencers sit above the phases: only what runs a step imports them (the
        # public API in `sandbox/__init__.py`, the CLI, verify's runs, the doctor's, and
        # the fleet's runner, the program a runner Job's Pod runs on its node).
        (
            "sandbox.run",
            (
                "sandbox",
                "sandbox.cli",
                "sandbox.verify",
                "sandbox.doctor",
                "sandbox.backends.kubernetes.fleetrunner",
            ),
        ),
        # The guard's application is assembled from its subsystems, never the other way.
        ("sandbox.guard.app", ("sandbox.guard.serve",)),
    ],
)
def test_no_upward_import(imported: str, allowed: tuple[str, ...]) -> None:
    """`allowed`: packages whose modules may import it (`sandbox`: its `__init__` only)."""
    upward = {
        name
        for name in importers_of(imported)
        if not inside(name, imported)
        and name not in allowed
        and not inside(name, *(a for a in allowed if a != "sandbox"))
    }
    assert upward == set()


@pytest.mark.parametrize(
    ("package", "may_import"),
    [
        # The record's and the wire's models import nothing mechanical.
        ("sandbox.contracts", ("sandbox.contracts",)),
        # Code inside the images is stdlib only.
        ("sandbox.stepside", ("sandbox.stepside",)),
        # The guard container holds the guard, the policy, the contracts and the step side.
        (
            "sandbox.guard",
            (
                "sandbox.guard",
                "sandbox.contracts",
                "sandbox.policy",
                "sandbox.policy_sql",
                "sandbox.stepside",
            ),
        ),
    ],
)
def test_a_package_imports_only_below_it(package: str, may_import: tuple[str, ...]) -> None:
    graph = import_graph()
    reached = {
        target
        for name, targets in graph.items()
        if inside(name, package)
        for target in targets
        if not inside(target, *may_import)
    }
    assert reached == set()


def imported_names(path: Path, name: str) -> set[str]:
    """The dotted names the module `name` at `path` imports (a relative import resolved;
    `from a import b` counted as `a` and `a.b`)."""
    return imported_modules(path.read_text(), name, path.name == "__init__.py")


def reaching(root: str, forbidden: tuple[str, ...]) -> dict[str, set[str]]:
    """Each module of the top-level package `root` that imports from one of `forbidden`,
    with what it imports of them."""
    found = {}
    for name, path in modules(root).items():
        hits = {m for m in imported_names(path, name) if inside(m, *forbidden)}
        if hits:
            found[name] = hits
    return found


def test_the_import_reader_sees_every_form_of_import(tmp_path: Path) -> None:
    module = tmp_path / "walls.py"
    for source in (
        "import tests.engines.fixtures",
        "import tests",
        "from tests.engines.fixtures import RUN_IMAGES",
        "from tests import paths",
        "def f():\n    from tests.kubernetes.cluster import Cluster\n",
        "from ...tests import paths",  # from bench.x.walls: up past the top
    ):
        module.write_text(source)
        found = imported_names(module, "bench.x.walls")
        assert any(inside(m, "tests") for m in found), source
    module.write_text("from testbed.engines import second_engine\nimport testsuite\n")
    assert not any(inside(m, "tests") for m in imported_names(module, "bench.walls"))


@pytest.mark.parametrize(
    ("root", "forbidden"),
    [
        # The bench is not a test: what it shares with the suite is the testbed's.
        ("bench", ("tests",)),
        # The testbed sits under both the suite and the bench.
        ("testbed", ("tests", "bench")),
        # The package is what a wheel ships: neither the suite nor the testbed is in it.
        ("sandbox", ("tests", "testbed")),
    ],
    ids=["bench", "testbed", "sandbox"],
)
def test_a_top_level_package_imports_none_above_it(root: str, forbidden: tuple[str, ...]) -> None:
    assert modules(root)  # the package is where the check looks
    assert reaching(root, forbidden) == {}
