"""The package's declared metadata holds what an installer and an image build rely on.

Every third-party module the package imports is a declared dependency, each dependency
is bounded below its next major, the guard image's pins (`images/constraints.txt`) pin
every runtime dependency inside its range, the metadata has a readme, a license and
classifiers, and `--version`, `sandbox.__version__` and the records say one version.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import sandbox
from sandbox import cli
from sandbox.cli import host as host_cmd
from sandbox.contracts.record import TestRunRecord
from sandbox.contracts.version import runner_version
from sandbox.contracts.workflow_record import WorkflowRunRecord
from sandbox.resources import images_dir
from tests import paths

ROOT = paths.REPO
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
RUNTIME = [Requirement(r) for r in PROJECT["dependencies"]]
OPTIONAL = [Requirement(r) for r in PROJECT["optional-dependencies"]["kubernetes"]]
# Imported by name in the images, never from the host's environment: the step side is
# installed module by module in the step image; `bench` is the checkout's (cli, dev only).
NOT_DISTRIBUTIONS = {"sandbox", "bench", "agentworks_bridge", "agentworks_mcp", "agentworks_exec"}


def _imported_modules() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "sandbox").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - NOT_DISTRIBUTIONS - {"__future__"}


def test_every_imported_module_is_a_declared_dependency() -> None:
    owners = importlib.metadata.packages_distributions()
    declared = {canonicalize_name(r.name) for r in RUNTIME + OPTIONAL}
    missing = {
        module: owners.get(module)
        for module in _imported_modules()
        if not {canonicalize_name(d) for d in owners.get(module, [])} & declared
    }
    assert not missing, f"imported, not declared in pyproject.toml: {missing}"


@pytest.mark.parametrize("req", RUNTIME + OPTIONAL, ids=str)
def test_every_dependency_is_bounded_below_its_next_major(req: Requirement) -> None:
    assert any(s.operator in {"<", "<=", "==", "~="} for s in req.specifier), (
        f"{req} has no upper bound"
    )


def test_the_image_constraints_pin_every_runtime_dependency_inside_its_range() -> None:
    pins: dict[str, str] = {}
    for line in (images_dir() / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"not a pin: {line!r}"
            pins[canonicalize_name(name)] = version
    for req in RUNTIME:
        pinned = pins.get(canonicalize_name(req.name))
        assert pinned is not None, f"images/constraints.txt does not pin {req.name}"
        assert req.specifier.contains(pinned), f"{req.name}=={pinned} is outside {req}"


def test_the_metadata_has_a_readme_a_license_and_classifiers() -> None:
    assert PROJECT["readme"] == "README.md" and (ROOT / "README.md").is_file()
    assert PROJECT["license"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert "Typing :: Typed" in PROJECT["classifiers"]
    assert PROJECT["version"] == runner_version()


def test_version_option_prints_the_distribution_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    printed = capsys.readouterr().out.strip()
    assert re.fullmatch(r"sandbox \S+", printed)
    assert printed == f"sandbox {importlib.metadata.version('sandbox')}"
    assert sandbox.__version__ == importlib.metadata.version("sandbox")


def test_records_carry_the_runner_version_and_old_records_still_load() -> None:
    for model in (TestRunRecord, WorkflowRunRecord):
        assert "runner_version" in model.model_json_schema()["properties"]
        assert model.model_fields["runner_version"].default is None  # old records: unknown


def test_bench_is_not_offered_without_the_checkouts_benchmarks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "bench" in cli.build_parser().format_help()
    monkeypatch.setattr(host_cmd, "bench_checkout", lambda: None)
    assert "bench" not in cli.build_parser().format_help()
    assert cli.main(["bench", "--quick"]) == 2
    assert "runs from a source checkout" in capsys.readouterr().err
