"""The built images start their Python from bytecode: every container runs with a
read-only root (and the guard with PYTHONDONTWRITEBYTECODE), so a module without its
current `.pyc` in the image would be compiled from source at every start, on the path
to the guard's first answer (the step's executor waits for it) and to the step's own
start. Each image's interpreter is asked (`python -v`) where every module it loaded on
that path came from, in a container run as a run's are (read-only root, no network)."""

from __future__ import annotations

import re

import pytest
from docker import DockerClient

from sandbox.contracts.names import GUARD_IMAGE, STEP_IMAGE

# `python -v` names the file each code object came from: the cached `.pyc` (quoted), or
# the source it compiled just then.
CODE_FROM = re.compile(r"^# code object from (.+)$", re.MULTILINE)

CASES = {
    # What the guard's entry imports before its gate (`sandbox.guard.__main__._load`),
    # and the packet log's binder that runs before it.
    "guard": (
        GUARD_IMAGE,
        [
            "/opt/guard/bin/python",
            "-v",
            "-c",
            "import sandbox.guard.nflogbind, sandbox.guard.startup",
        ],
    ),
    # The step's executor (`python3 -m agentworks_exec` runs its supervisor's main).
    "step": (STEP_IMAGE, ["python3", "-v", "-c", "import agentworks_exec.supervisor"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_images_start_their_python_from_bytecode(engine: DockerClient, case: str) -> None:
    image, command = CASES[case]
    output = engine.containers.run(
        image,
        command,
        entrypoint=[],
        read_only=True,
        network_mode="none",
        remove=True,
        stdout=True,
        stderr=True,
    ).decode()
    origins = CODE_FROM.findall(output)
    assert len(origins) > 20, output[-2000:]  # the check sees real imports
    compiled = [origin for origin in origins if not origin.endswith(".pyc'")]
    assert compiled == []
