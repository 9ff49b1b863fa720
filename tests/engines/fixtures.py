"""Session fixtures for second engines (imported by tests/conftest.py).

`second_engines` is the pool: one engine per configuration for the whole session,
started when a test first asks for it, all stopped at the end, then the host's engine
checked. It runs only with `-m second_engine` (`make test-walls`); without it a test
that asks for it is skipped. Before the pool starts, `sweep()` stops what a killed
session left. The session's base temp folder is shared with every engine, so
`tmp_path` folders (and a run's disk and view mounted in them) work as bind sources.

`SANDBOX_TEST_WALL=userns|runsc` runs a whole session in a second engine instead
(`make test-walls`): `wall_engine` (autouse, session) starts it before any test,
points `DOCKER_HOST` at it, so the `engine` fixture and every `TestRun` use it, and
for `runsc` sets `SANDBOX_STEP_RUNTIME=runsc`, so every step runs under gVisor while
its guard stays on runc. The session's main thread joins the engine's network
namespace, so host-side requests to a fake server's container address stay there. At the end it stops the engine by pid and checks the host's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from testbed.engines.engine_config import RUN_IMAGES, EngineConfig
from testbed.engines.second_engine import EnginePool, SecondEngine, sweep

MARKER = "second_engine"
WALL_ENV = "SANDBOX_TEST_WALL"
WALLS = {"userns": EngineConfig.userns, "runsc": EngineConfig.runsc}


def selected(config: pytest.Config) -> bool:
    return MARKER in (config.getoption("markexpr") or "")


@pytest.fixture(scope="session")
def second_engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EnginePool]:
    if not selected(request.config):
        pytest.skip(f"second engines run with -m {MARKER} (make test-walls)")
    sweep()
    pool = EnginePool(share=(tmp_path_factory.getbasetemp(),))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def runsc_engine(second_engines: EnginePool) -> SecondEngine:
    """runc by default; `runsc`, `runsc-host`, `runsc-host-sc` registered; run images loaded."""
    return second_engines.get(EngineConfig.runsc(), images=RUN_IMAGES)


@pytest.fixture(scope="session")
def userns_engine(second_engines: EnginePool) -> SecondEngine:
    """userns-remap on (`engine.remap`: the host range); run images loaded."""
    return second_engines.get(EngineConfig.userns(), images=RUN_IMAGES)


@pytest.fixture(scope="session", autouse=True)
def wall_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecondEngine | None]:
    """The second engine this session runs in (`SANDBOX_TEST_WALL`), or None."""
    wall = os.environ.get(WALL_ENV)
    if not wall:
        yield None
        return
    if wall not in WALLS:
        raise pytest.UsageError(f"{WALL_ENV}={wall!r}: one of {sorted(WALLS)}")
    sweep()
    pool = EnginePool(share=(tmp_path_factory.getbasetemp(),))
    saved = {k: os.environ.get(k) for k in ("DOCKER_HOST", "SANDBOX_STEP_RUNTIME")}
    try:
        engine = pool.get(WALLS[wall](), images=RUN_IMAGES)
        os.environ["DOCKER_HOST"] = engine.url
        if wall == "runsc":
            os.environ["SANDBOX_STEP_RUNTIME"] = "runsc"
        # The session joins the engine's network namespace (threads and processes it
        # starts later inherit it): a test reaching a container's address reaches that
        # engine's container, never one of the host's engine with the same address.
        with engine.netns():
            yield engine
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        pool.close()
