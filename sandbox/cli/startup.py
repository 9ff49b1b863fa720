"""The start of a process that runs steps: the collector's policy and the engine prefetch.

A controller starts one `sandbox run` per run, so what start-up costs is paid by every
run; both helpers here only save time and change no outcome.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandbox.backends import Backend, BackendFactory


class StartGc:
    """The collector while a process that runs steps starts: off while the command's
    modules load, frozen and back on once the first backend is connected.

    Start-up makes some 70,000 objects (modules, classes, the pydantic models' validators,
    the engine's client) that live until the process exits: a collection pass over them
    finds nothing, yet the allocations of the imports trigger one pass after another,
    and the interpreter's exit scans them all once more. `gc.freeze()` moves them to a
    generation the collector never visits, so the run's own collections (the collector
    is on again for everything the run allocates) and the exit's skip them. The price:
    the few cycles already garbage when frozen (about 1,600 objects) are kept until exit.
    Only for a process that is this command (`main()` reading `sys.argv`): a caller of
    `main([...])` keeps its own collector as it was."""

    def __init__(self) -> None:
        self._was_enabled = gc.isenabled()
        self._ended = False
        gc.disable()

    def end(self) -> None:
        """Freeze what start-up made and restore the collector; later calls do nothing."""
        if self._ended:
            return
        self._ended = True
        gc.freeze()
        if self._was_enabled:
            gc.enable()

    def after_connect(self, factory: BackendFactory) -> BackendFactory:
        """`factory`, ending start-up once it returns: the engine's client is its last
        import, and the run's work (copying, collecting) begins after it."""

        def connect() -> Backend:
            backend = factory()
            self.end()
            return backend

        return connect


def runs_on_docker(args: argparse.Namespace) -> bool:
    """Whether the command's runs use this host's Docker engine, known without reading
    a host config (that loads pydantic): `--backend docker`, or no host config at all
    (`sandbox.contracts.hostconfig`: then Docker runs everything). With a host config
    the engine is known only once it is read, and nothing is asked before."""
    if args.backend is not None:
        return bool(args.backend == "docker")
    from sandbox.contracts.hostpath import host_config_path

    return host_config_path(args.host_config) is None


def prefetch_engine(args: argparse.Namespace) -> None:
    """Ask the engine for its API version while the command imports (see
    `sandbox.backends.docker.prefetch`). Only a speed-up: a host config path that cannot
    even be looked at asks nothing here and is the run's own error, said as usual."""
    with contextlib.suppress(OSError):
        if runs_on_docker(args):
            from sandbox.backends.docker import prefetch

            prefetch.start()
