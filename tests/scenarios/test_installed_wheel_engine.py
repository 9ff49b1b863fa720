"""The package works installed, outside the checkout: data files come with the wheel.

Builds the wheel, installs it into a fresh venv in a temp folder (its dependencies
from the wheels the image build already made, when they are there), and from a
working folder outside the checkout builds the images under a tag of its own
(`sandbox images build`: the guard's copy of the package repacked from the installed
files), then runs `sandbox doctor` and a real test run on them. It fails when a data
file (the image build inputs, the seccomp profile, the record's JSON Schema) is left
out of the wheel or found through the checkout instead of the package.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import docker.errors
import pytest
from docker import DockerClient

from sandbox.backends.docker import images
from sandbox.contracts import names
from tests import paths
from tests.conftest import WorkflowFactory

pytestmark = pytest.mark.engine

REPO = paths.REPO
PIP_TIMEOUT_S = 600
BUILD_TIMEOUT_S = 900
# Its own tag: the images built from the wheel never replace the ones the suite runs.
TAG = f"{names.IMAGE_TAG}-wheel"


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


class Installed:
    def __init__(self, bin_dir: Path, deps: Path, cache: Path) -> None:
        self.bin_dir, self.deps, self.cache = bin_dir, deps, cache


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A fresh venv with the wheel of this checkout installed."""
    root = tmp_path_factory.mktemp("installed")
    wheels = root / "wheels"
    _pip(Path(sys.executable), "wheel", "--no-deps", "--wheel-dir", str(wheels), str(REPO))
    (wheel,) = wheels.glob("sandbox-*.whl")
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    deps = images.dependency_wheels(wheel)
    source = ["--no-index", "--find-links", str(deps)] if deps.is_dir() else []
    _pip(python, "install", *source, str(wheel))
    cache = root / "cache"
    # The MCP servers the checkout's image build fetched, where the installed build
    # looks for them (the same list hashes alike): neither pip nor npm fetches again.
    fetched = images.mcp_servers_cache()
    if fetched.is_dir():
        shutil.copytree(fetched, cache / "sandbox" / fetched.name, symlinks=True)
    return Installed(python.parent, deps, cache)


def _outside(
    where: Installed, *args: str, cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """A command of the installed venv, run where the checkout is not importable, with
    its own image tag and its own build cache (the wheels from the checkout's, when
    the checkout's image build has made them: no index needed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{where.bin_dir}:{env.get('PATH', '')}"
    env["SANDBOX_IMAGE_TAG"] = TAG
    env["XDG_CACHE_HOME"] = str(where.cache)
    if where.deps.is_dir():
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(where.deps))
    return subprocess.run(
        [str(where.bin_dir / args[0]), *args[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture()
def wheel_images(engine: DockerClient) -> Iterator[list[str]]:
    """The images' tags this test makes; removed afterwards (the hash tags it built
    only when nothing else still names that image)."""
    made: list[str] = []
    yield made
    ours = [f"{repo}:{TAG}" for repo in ("sandbox-step", "sandbox-guard", "sandbox-mcp")]
    for ref in [*ours, *made]:
        with contextlib.suppress(docker.errors.ImageNotFound, docker.errors.APIError):
            if ref in made and len(engine.images.get(ref).tags) > 1:
                continue
            engine.images.remove(ref)


def test_the_installed_wheel_builds_the_images_and_runs_on_them(
    engine: DockerClient,
    installed: Installed,
    wheel_images: list[str],
    make_workflow: WorkflowFactory,
    tmp_path: Path,
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _outside(
        installed, "python", "-c", "import sandbox; print(sandbox.__file__)", cwd=elsewhere
    )
    assert where.returncode == 0, where.stderr
    assert not Path(where.stdout.strip()).is_relative_to(REPO), where.stdout

    version = importlib.metadata.version("sandbox")
    shown = _outside(installed, "sandbox", "--version", cwd=elsewhere)
    assert (shown.returncode, shown.stdout) == (0, f"sandbox {version}\n"), shown.stderr
    # The benchmarks live in the checkout: the installed CLI neither offers nor runs them.
    helped = _outside(installed, "sandbox", "--help", cwd=elsewhere)
    assert helped.returncode == 0 and "bench" not in helped.stdout, helped.stdout
    bench = _outside(installed, "sandbox", "bench", cwd=elsewhere)
    assert bench.returncode == 2 and "source checkout" in bench.stderr, bench.stderr

    build = _outside(
        installed, "sandbox", "images", "build", "--json", cwd=elsewhere, timeout=BUILD_TIMEOUT_S
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    built = json.loads(build.stdout)
    wheel_images.extend(built["rebuilt"])
    # The guard holds this wheel's package (its metadata is not the checkout's pyproject):
    # built here, from the installed files, not found already built.
    assert built["guard"] in built["rebuilt"], built
    assert not (REPO / "sandbox" / "_data").exists()
    assert not list(installed.bin_dir.parent.glob("lib/python*/site-packages/build"))
    for role in ("step", "guard", "mcp"):
        assert engine.images.get(f"sandbox-{role}:{TAG}").id == engine.images.get(built[role]).id

    doctor = _outside(installed, "sandbox", "doctor", cwd=elsewhere)
    assert doctor.returncode == 0, doctor.stdout[-2000:] + doctor.stderr[-2000:]

    wf = make_workflow(command=["sh", "-c", 'echo done > "$PWD/out.txt"'])
    run = _outside(installed, "sandbox", "run", "--json", str(wf), "step1", cwd=elsewhere)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    record = json.loads(run.stdout)
    assert record["status"] == "passed", record["reason"]
    assert record["runner_version"] == version
    assert record["images"]["step"] == engine.images.get(f"sandbox-step:{TAG}").id
    assert (wf / "runs" / record["id"] / "g" / "out.txt").read_text() == "done\n"
