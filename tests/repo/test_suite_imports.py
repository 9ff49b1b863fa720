"""No module imports a test module (`test_*.py` under tests/): what two test files
share lives in a `conftest.py` (fixtures) or a helper module beside them (public
names). A test module imported elsewhere runs its tests, its module-level marks and
its collection twice over, and a change to one test file silently changes another's.

Read from the source with `ast` (every import, also those inside a function, plain
and relative), for the repository's Python outside the package: tests/, bench/,
testbed/, scripts/, examples/. A helper named `<name>parts` asserts as tests do (listed for
pytest's assert rewriting in tests/conftest.py), so its failures are explained too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests import paths
from tests.repo.importreader import imported_modules

IMPORTERS = ("tests", "bench", "testbed", "scripts", "examples")


def is_test_module(name: str) -> bool:
    return name.rpartition(".")[2].startswith("test_")


def imported_test_modules(source: str, name: str, is_package: bool = False) -> set[str]:
    """The test modules among what `name` imports."""
    return {m for m in imported_modules(source, name, is_package) if is_test_module(m)}


def repository_modules() -> dict[str, Path]:
    """The repository's Python outside the package, by dotted name (a package by its
    `__init__`), test data left out."""
    found = {}
    for root in IMPORTERS:
        for path in sorted((paths.REPO / root).rglob("*.py")):
            parts = list(path.relative_to(paths.REPO).with_suffix("").parts)
            if "data" in parts:
                continue
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def importers_of_test_modules() -> dict[str, frozenset[str]]:
    """Each module that imports a test module, and those it imports."""
    found = {}
    for name, path in repository_modules().items():
        source = path.read_text()
        imported = imported_test_modules(source, name, path.name == "__init__.py")
        imported.discard(name)
        if imported:
            found[name] = frozenset(imported)
    return found


def test_the_finder_sees_every_form_of_import() -> None:
    name = "tests.kubernetes.pods"
    for source in (
        "import tests.kubernetes.test_pod_shape",
        "import tests.kubernetes.test_pod_shape as shape",
        "from tests.kubernetes import test_pod_shape",
        "from tests.kubernetes.test_pod_shape import watch_pod",
        "from .test_pod_shape import watch_pod",
        "from . import test_pod_shape",
        "def f():\n    from tests.kubernetes.test_pod_shape import watch_pod\n",
    ):
        assert "tests.kubernetes.test_pod_shape" in imported_test_modules(source, name), source
    for source in (
        "from tests.kubernetes.pods import watch_pod",
        "from tests.conftest import write_workflow",
        "from sandbox.contracts.layout import is_test_run",
        "from . import pods",
    ):
        assert imported_test_modules(source, name) == set(), source
    package = "tests.kubernetes"
    assert imported_test_modules("from .test_backend import x", package, is_package=True) == {
        "tests.kubernetes.test_backend"
    }


def test_no_module_imports_a_test_module() -> None:
    assert importers_of_test_modules() == {}


def assert_rewritten() -> set[str]:
    """The modules tests/conftest.py hands to `pytest.register_assert_rewrite`."""
    tree = ast.parse((paths.TESTS / "conftest.py").read_text())
    return {
        arg.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "register_assert_rewrite"
        for arg in node.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
    }


def test_every_parts_helper_asserts_as_tests_do() -> None:
    helpers = {
        name
        for name in repository_modules()
        if name.startswith("tests.")
        and name.rpartition(".")[2].endswith("parts")
        and not name.rpartition(".")[2].startswith("test_")  # a test, not a helper
    }
    assert "tests.collect.logparts" in helpers  # the finder sees them
    assert helpers - assert_rewritten() == set()
