"""The package works installed, outside the checkout: data files come with the wheel.

Builds the wheel, installs it into a fresh venv in a temp folder (its dependencies
from the wheels the image build already made, when they are there), and from a
working folder outside the checkout runs `sandbox doctor` and a real test run on
the images this suite uses. It fails when a data file (the seccomp profile, the
record's JSON Schema, the image build inputs) is left out of the wheel or found
through the checkout instead of the package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from docker import DockerClient

from sandbox.backends.docker import images
from tests.conftest import WorkflowFactory

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
PIP_TIMEOUT_S = 600


def _pip(python: Path, *args: str) -> None:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(
        [str(python), "-m", "pip", "--quiet", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=PIP_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `bin/` of a fresh venv with the wheel of this checkout installed."""
    root = tmp_path_factory.mktemp("installed")
    wheels = root / "wheels"
    _pip(Path(sys.executable), "wheel", "--no-deps", "--wheel-dir", str(wheels), str(REPO))
    (wheel,) = wheels.glob("sandbox-*.whl")
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    deps = images.BUILD_DIR / "wheels" / ("deps-" + images._hash_files([REPO / "pyproject.toml"]))
    source = ["--no-index", "--find-links", str(deps)] if deps.is_dir() else []
    _pip(python, "install", *source, str(wheel))
    return python.parent


def _outside(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command of the installed venv, run where the checkout is not importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    return subprocess.run(
        [str(bin_dir / args[0]), *args[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_installed_wheel_runs_doctor_and_a_real_test_run(
    engine: DockerClient, installed: Path, make_workflow: WorkflowFactory, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _outside(
        installed, "python", "-c", "import sandbox; print(sandbox.__file__)", cwd=elsewhere
    )
    assert where.returncode == 0, where.stderr
    assert not Path(where.stdout.strip()).is_relative_to(REPO), where.stdout

    doctor = _outside(installed, "sandbox", "doctor", cwd=elsewhere)
    assert doctor.returncode == 0, doctor.stdout[-2000:] + doctor.stderr[-2000:]

    wf = make_workflow(command=["sh", "-c", 'echo done > "$PWD/out.txt"'])
    run = _outside(installed, "sandbox", "run", "--json", str(wf), "step1", cwd=elsewhere)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    record = json.loads(run.stdout)
    assert record["status"] == "passed", record["reason"]
    assert (wf / "runs" / record["id"] / "g" / "out.txt").read_text() == "done\n"
