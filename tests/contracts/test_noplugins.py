"""No pydantic plugin in the guard nor in a `sandbox` command that runs steps
(`sandbox.contracts.noplugins`): a distribution on the path that offers one (a
`pydantic` entry point whose module leaves a mark when it is imported) is never loaded,
and the guard's start does not import `importlib.metadata` for the look-up. Each in a
new interpreter; the first test shows the same plugin is loaded where nothing refuses
it, so the others can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import paths
from tests.conftest import guard_config


def _plugin_path(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose path holds a distribution with a pydantic plugin, and the
    file its module writes when it is imported."""
    site = tmp_path / "site"
    dist = site / "spy_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: spy-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pydantic]\nspy = spy_plugin:plugin\n")
    mark = tmp_path / "loaded"
    (site / "spy_plugin.py").write_text(
        f"open({str(mark)!r}, 'w').close()\n\n"
        "class _Plugin:\n"
        "    def new_schema_validator(self, *args, **kwargs):\n"
        "        return None, None, None\n\n"
        "plugin = _Plugin()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(paths.REPO)])
    return env, mark


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return _interpreter(["-c", textwrap.dedent(code)], env)


def _interpreter(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """This interpreter with `args`, on the plugin's path, from the repository."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=paths.REPO,
        timeout=120,
        check=False,
    )


def test_a_process_that_refuses_nothing_loads_the_plugin(tmp_path: Path) -> None:
    env, mark = _plugin_path(tmp_path)
    done = _python("from sandbox.contracts.guardparts import Egress; Egress()", env)
    assert done.returncode == 0, done.stderr
    assert mark.exists()


def test_the_guards_start_loads_no_plugin_and_no_package_metadata(tmp_path: Path) -> None:
    env, mark = _plugin_path(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(guard_config(tmp_path / "actions.jsonl").model_dump_json())
    done = _python(
        f"""
        import json, sys
        import sandbox.guard.__main__ as entry
        entry._load()  # what the guard's main loads before its gate
        from pydantic.plugin._schema_validator import create_schema_validator
        from sandbox.contracts.guardconfig import GuardConfig
        config = GuardConfig.model_validate_json(open({str(config)!r}, "rb").read())
        print(json.dumps([config.run_id, "importlib.metadata" in sys.modules]))
        """,
        env,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["test-x", False]
    assert not mark.exists()


def test_sandbox_run_validates_with_no_plugin(tmp_path: Path) -> None:
    env, mark = _plugin_path(tmp_path)
    workflow = tmp_path / "wf"
    workflow.mkdir()
    # Valid TOML the workflow's models refuse: pydantic has built and run its validators.
    (workflow / "workflow.toml").write_text('name = "wf"\nsteps = "not a list"\n')
    done = _interpreter(["-m", "sandbox.cli", "run", str(workflow), "s", "--json"], env)
    assert done.returncode == 4, done.stderr  # a configuration error
    assert "steps" in json.loads(done.stderr)["error"]["message"]
    assert not mark.exists()
